"""Run by tests/test_parallel.py under torchrun (2 processes): writes each rank's greedy outputs, and the error a
call with rank-dependent prompts gets, to ``OUT.<rank>.json``. ``--fault`` registers a plugin that fails on rank 1."""

import argparse
import json
import os

from deepinfer import LLM, SamplingParams
from deepinfer.plugins.manager import load_plugins, pm

PROMPTS = ["import os\n", "class Stack:", '"""Return the', "def main():\n    x = [", "for i in range(10):"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--fault", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.fault:
        import parallel_fault_plugin

        load_plugins()
        pm.register(parallel_fault_plugin, name="parallel_fault_plugin")
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM(args.model, device="cpu", dtype="float32", data_parallel_size=2,
             enable_expert_parallel=args.expert_parallel) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        try:
            llm.generate([f"rank {rank}"], params, use_tqdm=False)
            mismatch = None
        except ValueError as error:
            mismatch = str(error)
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump({"tokens": tokens, "mismatch": mismatch}, f)


if __name__ == "__main__":
    main()
