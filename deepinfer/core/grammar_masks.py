"""Structured outputs at sampling time: each constrained row's allowed tokens, filled on the host by its
request's ``GrammarMatcher`` while the device runs the forward pass, then applied to the logits on the device."""

from __future__ import annotations

import torch

WORD_BITS = 32


def apply_grammar_masks(logits: torch.Tensor, rows: list) -> None:
    """Sets to -inf, in place, the logits [R, vocab] of tokens each row's grammar forbids; ``rows`` holds each
    row's request (unconstrained rows are left as they are). Nothing runs when no row is constrained."""
    constrained = [i for i, request in enumerate(rows) if request.grammar is not None]
    if not constrained:
        return
    vocab = logits.shape[-1]
    words = -(-vocab // WORD_BITS)
    bitmask = torch.full((len(constrained), words), -1, dtype=torch.int32)
    for slot, i in enumerate(constrained):
        rows[i].grammar.fill_mask(bitmask, slot)
    device = logits.device
    bitmask = bitmask.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else bitmask
    bits = torch.arange(WORD_BITS, dtype=torch.int32, device=device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    index = torch.tensor(constrained, device=device) if len(constrained) < len(rows) else slice(None)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
