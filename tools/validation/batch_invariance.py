"""Batch invariance on a real-sized model (the H200 record): one request's output among random batch mates.

    DEEPINFER_BATCH_INVARIANT=1 python tools/validation/batch_invariance.py /tmp/flash4L --load-format dummy --runs 20

Prints one JSON line: the runs, how many distinct outputs the target request had (1 = invariant), and the time.
Run it with the mode off as well: a count above 1 there shows the harness can see a difference.
"""

from __future__ import annotations

import argparse
import json
import time

from deepinfer import LLM, envs
from deepinfer.testing.batch_mates import outputs_among_random_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="auto")
    args = parser.parse_args()
    start = time.perf_counter()

    def make_llm(**budget):
        return LLM(args.model, dtype=args.dtype, load_format=args.load_format, max_num_seqs=8, kv_cache_memory_gb=2,
                   **budget)

    outputs = outputs_among_random_batches(make_llm, args.runs)
    print(json.dumps({"model": args.model, "batch_invariant": envs.get().DEEPINFER_BATCH_INVARIANT, "runs": args.runs,
                      "distinct_outputs": len(outputs), "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
