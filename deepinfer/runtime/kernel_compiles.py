"""Triton kernels built in this process: each first call of a kernel at a new specialization (its constexprs, and
which integer arguments are 1 or multiples of 16) compiles it, or loads it from Triton's disk cache. A compile
takes 0.1-1 s, so one inside a timed run or a served request is a stall that its warm-up did not take; the engine
reports the count (``LLMEngine.counters``, ``/metrics``) beside its CUDA-graph captures."""

from __future__ import annotations

from deepinfer.logger import init_logger

logger = init_logger(__name__)

_built = 0
_counting = False


def count() -> int:
    """Triton kernels built since counting began (``start_counting``)."""
    return _built


def start_counting() -> None:
    """Counts Triton's builds through its post-compile hook (a hook set before is still called); idempotent, and
    nothing where Triton, or its hooks (Triton >= 3.4), are absent."""
    global _counting
    if _counting:
        return
    try:
        from triton import knobs
    except ImportError:
        return
    previous = knobs.runtime.jit_post_compile_hook

    def built(**kwargs):
        global _built
        _built += 1
        logger.debug("built Triton kernel %s", kwargs.get("repr"))
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = built
    _counting = True
