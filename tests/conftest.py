import os
import sys

import pytest
import torch

# Before any torch op starts the intra-op thread pool, so every worker thread inherits it:
# subnormal floats from the tiny random models make CPU kernels ~100x slower.
torch.set_flush_denormal(True)
# Without a GPU, Triton kernels can only run in Triton's interpreter. Triton reads the switch once, when it is
# first imported, and other imports (transformers' models) may import it before the kernel tests do.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deepinfer import envs
from deepinfer.logger import ROOT_LOGGER_NAME, init_logger
from deepinfer.plugins import manager

# Read by deepinfer.plugins.load_plugins: under test, installed entry-point plugins are not
# loaded unless a test asks for them, so the machine's packages cannot change results.
sys._called_from_test = True


@pytest.fixture(autouse=True)
def hermetic_envs(monkeypatch):
    """Tests change DEEPINFER_* with monkeypatch and call envs.reload(); undo both afterwards."""
    parsed_before = envs.get()
    yield
    # Restore os.environ first (monkeypatch would do it only after this teardown) so the
    # re-parse sees the environment the next test starts with.
    monkeypatch.undo()
    if envs.get() is not parsed_before:
        envs.reload()


@pytest.fixture(autouse=True)
def hermetic_plugins():
    """Plugins a test registers (directly or through load_plugins) are gone after it."""
    registered_before = {name for name, _ in manager.pm.list_name_plugin()}
    loaded_before = manager._loaded
    yield
    for name, plugin in manager.pm.list_name_plugin():
        if plugin is not None and name not in registered_before:
            manager.pm.unregister(name=name)
    # Otherwise a later load_plugins() would do nothing and leave the built-ins unregistered.
    manager._loaded = loaded_before


@pytest.fixture
def caplog(caplog):
    """caplog listens on the root logger, which the ``deepinfer`` tree does not propagate to."""
    deepinfer_root = init_logger(ROOT_LOGGER_NAME)
    deepinfer_root.addHandler(caplog.handler)
    yield caplog
    deepinfer_root.removeHandler(caplog.handler)


@pytest.fixture
def install(tmp_path, monkeypatch):
    """``install(distribution, entry_points, source)`` lays a distribution out as pip would.

    ``entry_points`` maps names to targets in group ``deepinfer.plugins``; ``source``, if
    given, becomes module ``<distribution>.py`` beside ``<distribution>-0.1.dist-info``.
    """
    modules_written = []

    def install_distribution(distribution: str, entry_points: dict[str, str], source: str | None = None):
        site = tmp_path / distribution
        info = site / f"{distribution}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n")
        lines = [f"[{manager.ENTRY_POINT_GROUP}]"] + [f"{name} = {target}" for name, target in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        if source is not None:
            (site / f"{distribution}.py").write_text(source)
            modules_written.append(distribution)
        monkeypatch.syspath_prepend(site)

    yield install_distribution
    # Another test may install a different module under the same name.
    for module in modules_written:
        sys.modules.pop(module, None)


@pytest.fixture(scope="session")
def tiny_vision_dspark_checkpoint(tmp_path_factory):
    """``tiny_vision_checkpoint`` with random DSpark draft stages (``make_tiny --arch v41 --vision --dspark``)."""
    from deepinfer.testing import make_tiny

    out = tmp_path_factory.mktemp("tiny_vision_dspark")
    make_tiny.main([str(out), "--arch", "v41", "--vision", "--dspark"])
    return out


@pytest.fixture(scope="session")
def tiny_vision_checkpoint(tmp_path_factory):
    """``make_tiny --arch v41 --vision``'s checkpoint (the one tools/goldens/v41_vision_golden.py made the goldens of
    tests/fixtures/v41_vision from), built once per run."""
    from deepinfer.testing import make_tiny

    out = tmp_path_factory.mktemp("tiny_vision")
    make_tiny.main([str(out), "--arch", "v41", "--vision"])
    return out


@pytest.fixture(scope="session")
def tiny_v4_checkpoint(tmp_path_factory):
    """A tiny random DeepSeek-V4 checkpoint written by HF transformers (built once per run)."""
    from deepinfer.testing.tiny_v4 import build_tiny_v4

    return build_tiny_v4(tmp_path_factory.mktemp("tiny_v4"))
