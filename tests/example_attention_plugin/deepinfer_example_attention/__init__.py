"""An example third-party attention backend: the torch reference with torch's fused RMSNorm.

An attention backend owes the engine the whole ``AttentionBackend`` protocol (``deepinfer/plugins/interfaces.py``;
the engine checks it when it selects the backend). The shortest correct one starts from the reference and replaces
what it accelerates, here ``rms_norm`` (attention's norms and the final one). Installed
(``pip install tests/example_attention_plugin``), its entry point makes DeepInfer register this module; installed
plugins are asked before the built-ins, so it serves every device it accepts.
"""

from __future__ import annotations

import torch

from deepinfer.plugins import hookimpl
from deepinfer.plugins.builtin.torch_attention import TorchAttention


class FusedNormAttention(TorchAttention):
    name = "example-fused-norm"
    graph_safe = True  # no host synchronisation, shapes follow inputs: CUDA graphs may capture it
    batch_invariant = False  # not vouched for: batch-invariant mode then refuses to start with it

    def __init__(self) -> None:
        self.norm_calls = 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        # the protocol's contract (deepinfer.runtime.ops.rms_norm): fp32 arithmetic, the result in x's dtype
        self.norm_calls += 1
        return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


@hookimpl
def deepinfer_attention_backend(config, device):
    if device.type not in ("cpu", "cuda"):
        return None  # the next plugin, finally the torch reference, answers
    return FusedNormAttention()
