"""Programmatic dependent launch (SM90 and later): every kernel of this plugin is launched with ``LAUNCH`` and calls
``wait_for_inputs()`` before it reads what an earlier kernel wrote or writes anything. The GPU then starts a kernel's
programs while the kernel before it in the stream is still finishing, instead of after it drained, which hides each
kernel's start-up behind its predecessor's tail: a batch-1 decode step is ~400 short kernels (measured: 1.5% of
V4.1's step on an H100, BENCHMARKS.md). A kernel may read what no kernel writes (its weights) before it waits.
``DEEPINFER_DEPENDENT_LAUNCH=0`` launches them one after another as before.

A kernel launched with ``LAUNCH`` that does not wait would race its predecessor:
``tests/test_nvidia_dependent_launch.py`` checks every launch and every launched kernel of the package.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.logger import init_logger
from deepinfer_nvidia import INTERPRETED

logger = init_logger(__name__)


def _enabled() -> bool:
    if INTERPRETED or not envs.get().DEEPINFER_DEPENDENT_LAUNCH:
        return False
    # without a GPU (compile_check), the kernels are built for SM90, where the instructions exist
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 9


ENABLED = _enabled()
_WAIT = tl.constexpr(ENABLED)
# the launch option: each kernel's programs may start once every program of the previous kernel called
# wait_for_inputs (or ended)
LAUNCH = {"launch_pdl": True} if ENABLED else {}
if torch.cuda.is_available() and not INTERPRETED:
    logger.info("Triton kernels: programmatic dependent launch %s", "on" if ENABLED else "off")


@triton.jit
def wait_for_inputs():
    """Wait until the previous kernel in the stream has ended and its writes are visible, then let the next kernel's
    programs start (they wait here in turn). Outside a dependent launch both return at once."""
    if _WAIT:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
