"""Structured outputs at sampling time: each constrained row's allowed tokens, filled on the host by its
request's ``GrammarMatcher`` while the device runs the forward pass, then applied to the logits on the device."""

from __future__ import annotations

import torch

WORD_BITS = 32


def apply_grammar_masks(logits: torch.Tensor, rows: list[tuple]) -> None:
    """Sets to -inf, in place, the logits [R, vocab] of tokens each row's grammar forbids. ``rows`` holds each
    row's (request, j): the row after its ``j``-th draft (speculative decoding), its mask the grammar's state
    after those drafts; a request's rows come together, j = 0, 1, .... Unconstrained rows are left as they are,
    and so are the rows of requests found finished after this step was scheduled (their tokens are discarded);
    nothing runs when no row is constrained."""
    constrained = [i for i, (request, _) in enumerate(rows) if request.grammar is not None and not request.finished]
    if not constrained:
        return
    vocab = logits.shape[-1]
    words = -(-vocab // WORD_BITS)
    bitmask = torch.full((len(constrained), words), -1, dtype=torch.int32)
    for slot, i in enumerate(constrained):
        request, j = rows[i]
        if j:  # the drafts before this row: allowed (checked when they were set), undone after the last row
            request.grammar.accept(request.draft_token_ids[j - 1])
        request.grammar.fill_mask(bitmask, slot)
        if j == request.num_drafts and j:
            request.grammar.rollback(j)
    device = logits.device
    bitmask = bitmask.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else bitmask
    bits = torch.arange(WORD_BITS, dtype=torch.int32, device=device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    index = torch.tensor(constrained, device=device) if len(constrained) < len(rows) else slice(None)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def allowed_drafts(grammar, tokens: list[int]) -> int:
    """How many leading ``tokens`` the grammar allows, stopping before one that would end it (the row after an
    ended grammar would have nothing to sample); the grammar's state is left as it was."""
    count = 0
    for token in tokens:
        if not grammar.accept(token):
            break
        count += 1
        if grammar.terminated:
            count -= 1
            grammar.rollback(1)
            break
    if count:
        grammar.rollback(count)
    return count
