"""One request among random batch mates: the harness of batch-invariant mode's test and of
``tools/validation/batch_invariance.py``."""

from __future__ import annotations

import gc
import random
from collections import Counter
from collections.abc import Callable

import torch

from deepinfer import LLM, SamplingParams

WORDS = "the of and to in is you that it he was for on are as with his they at be this have from".split()
TARGET = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 2
# sampled with its own noise: the drawn tokens and every logprob must repeat
TARGET_PARAMS = SamplingParams(temperature=0.8, top_p=0.95, seq_seed=1234, max_tokens=12, ignore_eos=True, logprobs=3)
BUDGETS = (16, 24, 64, 2048)  # max_num_batched_tokens: the first three chunk the target's prompt


def _mate_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "sampled", "seeded"])
    max_tokens = rng.randint(1, 12)  # up to the target's: mates finish before, with or after it
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=max_tokens)
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seq_seed=rng.randint(0, 99) if kind == "seeded" else None)


def output_key(completion) -> tuple:
    """Token ids, every returned logprob with its rank, and the cumulative logprob: compared bitwise."""
    logprobs = tuple(tuple(sorted((t, lp.logprob, lp.rank) for t, lp in step.items())) for step in completion.logprobs)
    return tuple(completion.token_ids), logprobs, completion.cumulative_logprob


def outputs_among_random_batches(make_llm: Callable[..., LLM], runs: int, seed: int = 0,
                                 target_params: SamplingParams = TARGET_PARAMS) -> Counter:
    """The target request's output in ``runs`` generate calls, each with 0-7 random batch mates (random prompts,
    lengths and sampling), the target at a random place, and a random step budget from ``BUDGETS`` (chunked
    prefill or not). ``make_llm(max_num_batched_tokens=...)`` builds one engine per budget, one at a time (a
    full-size model may not fit twice)."""
    rng = random.Random(seed)
    plans = []
    for _ in range(runs):
        budget = rng.choice(BUDGETS)
        # up to 30 words: the target's prompt (~40 tokens) shares chunked-prefill steps with mates of every length
        mates = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(rng.randint(0, 7))]
        at = rng.randint(0, len(mates))
        params = [_mate_params(rng) for _ in mates]
        plans.append((budget, mates[:at] + [TARGET] + mates[at:], params[:at] + [target_params] + params[at:], at))
    outputs = Counter()
    for budget in sorted({plan[0] for plan in plans}):
        llm = make_llm(max_num_batched_tokens=budget)
        for _, prompts, params, at in (plan for plan in plans if plan[0] == budget):
            outputs[output_key(llm.generate(prompts, params, use_tqdm=False)[at].outputs[0])] += 1
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return outputs
