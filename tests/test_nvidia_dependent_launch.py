"""Programmatic dependent launch is only safe if every kernel launched with it waits for its inputs before it reads
an earlier kernel's output or writes anything (``deepinfer_nvidia.dependent_launch``). These checks read the
package's source, so they run without a GPU; the kernels' results with it on are the GPU tests' business."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "backends" / "nvidia" / "deepinfer_nvidia"
# kernels that read their weights (written at load time, never by the kernel just before) before they wait
WEIGHTS_BEFORE_WAIT = {"_fp8_gemv_kernel", "_logits_kernel"}
WAIT = "wait_for_inputs"


def _modules() -> dict[str, ast.Module]:
    return _parsed(PACKAGE)


@functools.cache
def _parsed(package: Path) -> dict[str, ast.Module]:
    """Each module of ``package`` parsed once, for every parametrized check."""
    return {path.name: ast.parse(path.read_text()) for path in sorted(package.glob("*.py"))}


def _is_jit(function: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in function.decorator_list)


def _jit_functions() -> dict[tuple[str, str], ast.FunctionDef]:
    return {(module, node.name): node for module, tree in _modules().items() for node in tree.body
            if isinstance(node, ast.FunctionDef) and _is_jit(node)}


def _called_names(node: ast.AST) -> set[str]:
    """Names called as ``f(...)`` or ``module.f(...)``."""
    calls = [call.func for call in ast.walk(node) if isinstance(call, ast.Call)]
    return ({func.id for func in calls if isinstance(func, ast.Name)}
            | {func.attr for func in calls if isinstance(func, ast.Attribute)})


def _kernels() -> dict[tuple[str, str], ast.FunctionDef]:
    """The jit functions no jit function calls: what the host launches (helpers are inlined into kernels)."""
    functions = _jit_functions()
    called = set().union(*(_called_names(function) for function in functions.values()))
    return {key: function for key, function in functions.items() if function.name not in called}


def _launches() -> list[tuple[str, int, ast.Call]]:
    """Every ``name[grid](...)`` call of the package."""
    return [(module, call.lineno, call) for module, tree in _modules().items() for call in ast.walk(tree)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)
            and isinstance(call.func.value, ast.Name)]


def _writes(node: ast.AST) -> bool:
    source = ast.unparse(node)
    return "tl.store" in source or "tl.atomic" in source or any(
        isinstance(part, ast.Call) and isinstance(part.func, ast.Name) and "store" in part.func.id
        for part in ast.walk(node))


def test_the_package_has_kernels_and_launches():
    assert len(_kernels()) > 30 and len(_launches()) > 30  # the checks below would pass vacuously otherwise


@pytest.mark.parametrize("module, line, call", _launches(), ids=lambda v: v if isinstance(v, (str, int)) else "")
def test_every_launch_passes_the_launch_option(module, line, call):
    assert any(keyword.arg is None and ast.unparse(keyword.value) == "LAUNCH" for keyword in call.keywords), (
        f"{module}:{line} launches {ast.unparse(call.func.value)} without **LAUNCH")


@pytest.mark.parametrize("key", sorted(_kernels()), ids="{0[0]}:{0[1]}".format)
def test_every_kernel_waits_before_its_inputs_and_writes(key):
    """The wait is a top-level statement of the kernel (no branch can skip it), the first one unless the kernel is
    known to read only its weights before it."""
    body = _kernels()[key].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    waits = [i for i, statement in enumerate(body) if ast.unparse(statement) == f"{WAIT}()"]
    assert waits, f"{key} is launched with dependent launch but never calls {WAIT}()"
    before = body[:waits[0]]
    if key[1] not in WEIGHTS_BEFORE_WAIT:
        assert not before, f"{key}: {WAIT}() must come first: {ast.unparse(before[0])}"
    for statement in before:  # what may come first: reads of weights (the allowlist's word), never a write
        assert not _writes(statement), f"{key} writes before {WAIT}(): {ast.unparse(statement)}"


def test_the_rule_finds_a_kernel_that_does_not_wait(tmp_path, monkeypatch):
    """The checks catch what they are for: a kernel without the wait, a launch without the option."""
    (tmp_path / "bad.py").write_text(
        "import triton\n\n@triton.jit\ndef _bad_kernel(x_ptr):\n    tl.store(x_ptr, 1)\n\n\n"
        "def launch(x):\n    _bad_kernel[(1,)](x)\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    assert list(_kernels()) == [("bad.py", "_bad_kernel")]
    with pytest.raises(AssertionError, match="never calls"):
        test_every_kernel_waits_before_its_inputs_and_writes(("bad.py", "_bad_kernel"))
    with pytest.raises(AssertionError, match="without"):
        test_every_launch_passes_the_launch_option(*_launches()[0])
