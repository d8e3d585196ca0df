"""The count of Triton kernels built in the process (``runtime/kernel_compiles.py``), through Triton's hook."""

from __future__ import annotations

import pytest

from deepinfer.runtime import kernel_compiles


def test_builds_are_counted_and_a_hook_set_before_still_runs(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kwargs: seen.append(kwargs["repr"]))
    monkeypatch.setattr(kernel_compiles, "_counting", False)
    kernel_compiles.start_counting()
    kernel_compiles.start_counting()  # idempotent: one hook, one count a build
    before = kernel_compiles.count()
    knobs.runtime.jit_post_compile_hook(key=(), repr="matmul[num_warps=4]", fn=None, compile={},
                                        is_manual_warmup=False, already_compiled=False)
    assert kernel_compiles.count() == before + 1 and seen == ["matmul[num_warps=4]"]
