"""The ``deepinfer_prefill_truncation`` hook: with ``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact`` the
window-only decoder layers of DeepSeek-V4.1 (those after its last KV-source layer) prefill only each prompt's
last ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`` tokens. The engine checks the model and the suffix's length against
the sliding window and the longest backtrack."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.plugins.hookspecs import hookimpl


@dataclass(frozen=True, slots=True)
class BoundedReplay:
    keep_tokens: int
    name: str = "compact"

    def replay_start(self, num_prompt_tokens: int) -> int:
        return max(0, num_prompt_tokens - self.keep_tokens)


@hookimpl
def deepinfer_prefill_truncation(config, model_config):
    if config.prefill_truncation_mode != "compact":
        return None
    return BoundedReplay(config.prefill_keep_tokens)
