"""A drafter's greedy acceptance in the engine, at every position and at the anchors speculative decoding visits.

    PYTHONPATH=.:features/mtp python tools/validation/draft_acceptance.py [--model deepinfer-tiny-v4.1] [--prompts 32]
        [--prompt-len 128] [--new-tokens 96] [--quantization none]

(It turns speculative decoding on itself: ``DEEPINFER_PLUGINS=mtp`` and ``DEEPINFER_ENABLE_MTP_VARLEN=0`` unless
set otherwise.)

One greedy run drafts after every step but verifies nothing (plain decoding), so every position of every
continuation is an anchor; each block is then scored against the continuation as verification would score it
(the leading drafts equal to it). Two means come out:

- ``every_position``: over all anchors with a whole block left, what a training run's teacher-forced protocol
  measures (``tools/training/tiny_v41_metrics.py``'s ``dspark_acceptance``);
- ``engine_visited``: over the anchors speculative decoding reaches (from the first, jump past each block's
  accepted drafts and the bonus token), which is what the engine reports with fixed-length verification on the
  same prompts: easy stretches are crossed in a few long blocks, so hard ones weigh more there.

Prompts are evenly spaced windows of the held-out standard-library files (``tools/training/eval_tiny_v41.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DEEPINFER_PLUGINS", "mtp")
os.environ.setdefault("DEEPINFER_ENABLE_MTP_VARLEN", "0")

from deepinfer import LLM, SamplingParams  # noqa: E402 (after the environment it reads)
from deepinfer.engine import speculation  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from eval_tiny_v41 import heldout_windows  # noqa: E402


def record_drafts_verify_none(blocks: list) -> None:
    """Make every Speculator keep each request's whole draft block in ``blocks`` as (request id, position, tokens)
    and verify none of it."""
    draft = speculation.Speculator.draft

    def drafting_only(self, running, computed):
        self.confidence_scheduling = False  # whole blocks, whatever DEEPINFER_ENABLE_MTP_VARLEN says
        draft(self, running, computed)
        for request in running:
            if request.num_drafts:
                start = len(request.token_ids) - request.num_drafts
                blocks.append((request.request_id, start, list(request.token_ids[start:])))
                request.drop_drafts()

    speculation.Speculator.draft = drafting_only


def accepted(block: list[int], continuation: list[int], start: int) -> int | None:
    """Leading drafts equal to the continuation from ``start``; None without a whole block left."""
    if start + len(block) > len(continuation):
        return None
    count = 0
    while count < len(block) and block[count] == continuation[start + count]:
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepinfer-tiny-v4.1")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--quantization", choices=("none",), help="none: dequantize the weights at load")
    args = parser.parse_args()
    blocks: list = []
    record_drafts_verify_none(blocks)
    llm = LLM(model=args.model, **({"quantization": args.quantization} if args.quantization else {}))
    if llm.engine.speculator is None:
        raise SystemExit(f"no drafter serves {args.model}: it needs draft stages (DSpark or MTP) and the mtp plugin")
    stream = [t for window in heldout_windows(llm.tokenizer, 200_000) for t in window]
    spacing = (len(stream) - args.prompt_len) // args.prompts
    prompts = [stream[i * spacing:i * spacing + args.prompt_len] for i in range(args.prompts)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True),
                           use_tqdm=False)
    sequences = {o.request_id: o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outputs}
    per_request: dict[str, dict[int, int]] = {}
    for request_id, start, block in blocks:
        count = accepted(block, sequences[request_id], start)
        if count is not None:
            per_request.setdefault(request_id, {})[start] = count
    every = [count for anchors in per_request.values() for count in anchors.values()]
    visited = []
    for anchors in per_request.values():
        start = min(anchors)
        while start in anchors:
            visited.append(anchors[start])
            start += anchors[start] + 1
    print(json.dumps({"every_position": round(1 + sum(every) / len(every), 4), "anchors": len(every),
                      "engine_visited": round(1 + sum(visited) / len(visited), 4), "visited_anchors": len(visited),
                      "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                      "quantization": args.quantization or "as shipped"}))


if __name__ == "__main__":
    main()
