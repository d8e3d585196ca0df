"""Evaluation of the embedded model on NeMo's implementation during training (``tools/training/train_tiny_v41.py``).

Held-out loss and its unigram baseline, greedy continuations (and the prompts of the recorded samples), and DSpark
greedy acceptance with its protocol and prompts. (``eval_tiny_v41.py`` scores the checkpoint through DeepInfer's
engine instead.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SAMPLE_PROMPTS = ("def fibonacci(n):", '"""Return the', "import os\n")


# ---------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, batch: int, device, autocast) -> tuple[float, int]:
    """Mean next-token cross-entropy over non-overlapping windows of the held-out stream."""
    model.eval()
    n = (stream.numel() - 1) // seq_len
    total, count = 0.0, 0
    for start in range(0, n, batch):
        idx = torch.arange(start, min(start + batch, n)).unsqueeze(1) * seq_len + torch.arange(seq_len + 1)
        x = stream[idx].long().to(device)
        with autocast:
            logits = model(x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    return total / max(count, 1), count


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab: int, seq_len: int) -> float:
    """Held-out cross-entropy under add-one-smoothed training-split token frequencies (same targets as above)."""
    counts = torch.bincount(train.long(), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    n = (heldout.numel() - 1) // seq_len
    targets = heldout[1 : n * seq_len + 1].view(n, seq_len).flatten().long()
    return float(-logp[targets].mean())


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int, eos: int | None = None) -> torch.Tensor:
    """Greedy continuation by re-running the whole sequence for each token (NeMo's model has no KV cache)."""
    model.eval()
    for _ in range(new_tokens):
        nxt = model(ids).logits[:, -1].float().argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        if eos is not None and ids.shape[0] == 1 and int(nxt) == eos:
            break
    return ids


@torch.no_grad()
def dspark_acceptance(model, draft, capture, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Greedy DSpark acceptance on the target's own greedy continuations of held-out prompts.

    For every anchor in the continuation the draft proposes ``dspark_block_size`` tokens; greedy verification
    accepts the prefix that matches the target's argmax, plus the target's own (bonus) token. The Markov head reads
    the previous token, which inside an accepted prefix is the matched token, so teacher forcing on the target's
    continuation gives the acceptance that semi-autoregressive drafting gets. Returns the mean acceptance length
    (accepted + 1) and the per-position acceptance rates.
    """
    model.eval()
    draft.eval()
    seqs = greedy(model, prompts, new_tokens)
    out = model(seqs, return_hidden_states=True)
    features = capture.features()
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, prompts.shape[1] - 1 :] = 1  # anchors: last prompt token and the continuation
    saved = draft.num_anchors
    draft.num_anchors = seqs.shape[1]  # every valid anchor
    try:
        d = draft(input_ids=seqs, target_hidden_states=features, loss_mask=loss_mask,
                  target_last_hidden_states=out.hidden_states)
    finally:
        draft.num_anchors = saved
    match = (d.draft_logits.argmax(-1) == d.aligned_target_logits.argmax(-1)) & d.eval_mask
    full = d.eval_mask.all(-1) & d.block_keep_mask  # anchors with a whole block left to verify
    accepted = match.int().cumprod(-1)[full]
    return {
        "mean_acceptance_length": float(accepted.sum(-1).float().mean() + 1) if accepted.numel() else None,
        "acceptance_rate_by_position": [round(float(v), 4) for v in accepted.float().mean(0)],
        "anchors": int(full.sum()),
        "prompts": int(prompts.shape[0]),
        "prompt_tokens": int(prompts.shape[1]),
        "continuation_tokens": new_tokens,
    }


# (prompts, prompt tokens, continuation tokens) of the DSpark greedy acceptance measurement
ACCEPTANCE_PROTOCOL = {"cuda": (32, 128, 96), "cpu": (2, 32, 16)}


def acceptance_prompts(stream: torch.Tensor, n_prompts: int, prompt_len: int, device) -> torch.Tensor:
    """Evenly spaced windows of the held-out stream."""
    n_prompts = max(1, min(n_prompts, (stream.numel() - 1) // prompt_len))
    starts = torch.arange(n_prompts) * ((stream.numel() - prompt_len) // n_prompts)
    return stream[starts.unsqueeze(1) + torch.arange(prompt_len)].long().to(device)
