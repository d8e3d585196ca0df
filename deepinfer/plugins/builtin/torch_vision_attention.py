"""The reference vision attention: torch's ``scaled_dot_product_attention`` over one image's patches, as NeMo
AutoModel's tower calls it (torch picks its kernel)."""

from __future__ import annotations

from deepinfer.models.deepseek_v41.vision import vision_attention
from deepinfer.plugins.hookspecs import hookimpl


class TorchVisionAttention:
    name = "torch-reference"

    def attention(self, q, k, v):
        return vision_attention(q, k, v)


@hookimpl(trylast=True)
def deepinfer_vision_attention_backend(config, device):
    return TorchVisionAttention()
