"""An example third-party plugin: a sampler that always takes the most likely token.

Installed (``pip install tests/example_plugin``), its entry point makes DeepInfer register
this module, and because installed plugins are asked before the built-ins, its sampler
replaces the built-in one. Set ``DEEPINFER_PLUGINS=""`` to go back to the built-in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.plugins import hookimpl
from deepinfer.plugins.interfaces import SamplerOutput, SamplingBatch


@dataclass(slots=True)
class CountingGreedySampler:
    """Argmax for every row, whatever the sampling parameters say; counts its calls."""

    name: str = "example-greedy"
    calls: int = 0

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        self.calls += 1
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token_ids = logprobs.argmax(dim=-1)
        top_logprobs, top_logprob_ids = None, None
        if batch.num_logprobs > 0:
            top_logprobs, top_logprob_ids = logprobs.topk(batch.num_logprobs, dim=-1)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1),
            top_logprob_ids=top_logprob_ids,
            top_logprobs=top_logprobs,
        )


SAMPLER = CountingGreedySampler()


@hookimpl
def deepinfer_sampler():
    # A hookimpl may take any subset of the spec's arguments (config, device); this one
    # needs neither. Returning None instead would let the next plugin answer.
    return SAMPLER
