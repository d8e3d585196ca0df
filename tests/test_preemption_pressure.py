"""64 requests in a cache of six 16-token blocks: requests are preempted and recomputed, and every output (greedy, in input
order) equals the one an unpressured engine gives. In batch-invariant mode: without it a request's greedy tokens
already depend on its batch mates (max_num_seqs 3 or 8 changes 3 of 40 outputs), which preemption reshuffles."""

import importlib

import pytest

from deepinfer import LLM, SamplingParams, envs
from deepinfer.plugins.manager import registered

pytest.importorskip("deepinfer_batch_invariant.plugin", reason="features/batch_invariant is not installed (build.sh)")
from deepinfer_batch_invariant import cpu_checks  # noqa: E402

pytestmark = pytest.mark.skipif(bool(cpu_checks.cpu_problems(16)), reason="batch-invariant mode cannot run here")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 12-token prompts: the fifth new token is computed at position 16, past the first 16-token block, so running
# requests need a second one
BLOCK = 16
# 64: the pressured run preempts from the first wave on (31 preemptions; 200 requests gave 99 at 3x the time), and
# more requests than the 40 that showed batch dependence without the mode
PROMPTS = [[(7 * i + 3 * j) % 3000 + 5 for j in range(12)] for i in range(64)]


def run(**engine_args):
    with registered(importlib.import_module("deepinfer_batch_invariant.plugin"), "batch_invariant"):
        llm = LLM("deepinfer-tiny-v4.1", dtype="float32", max_num_seqs=16, enable_prefix_caching=False,
                  block_size=BLOCK, **engine_args)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(o.finished and len(o.outputs[0].token_ids) == 6 for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], llm.engine.counters()["preemptions"]


def test_outputs_under_preemption_equal_an_unpressured_run(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    envs.reload()
    pressured, preemptions = run(num_cache_tokens=BLOCK * 6)
    assert preemptions > 0, "the cache was meant to be too small for the batch"
    unpressured, none = run()
    assert none == 0
    assert pressured == unpressured
