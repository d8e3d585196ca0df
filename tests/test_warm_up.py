"""A server's warm-up (``engine/warm_up.py``): it runs the prompt lengths and decode batch sizes it promises, its
made-up requests leave no trace in what clients read or get, and ``--warm-up`` reaches it from both servers."""

from __future__ import annotations

import argparse
import importlib

import pytest
import torch

from deepinfer.engine import warm_up as warm_up_module
from deepinfer.engine.draft_policy import DraftPolicy
from deepinfer.engine.warm_up import _RandomPrompts, decode_batch_sizes, warm_up, warm_up_server

MODEL = "deepinfer-tiny-v4.1"
PROMPTS = ["def fibonacci(n):", "import os\n"]


def _embedded(**engine_args):
    from deepinfer import LLM
    from deepinfer.plugins.manager import registered

    # steps padded as CUDA graphs replay them (float32's reference experts keep real graphs off): with drafts, the
    # overlapped verification a GPU runs
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        return LLM(MODEL, dtype="float32", quantization="none", max_num_seqs=3, cuda_graphs="padded-eager",
                   **engine_args)


def test_decode_batch_sizes_are_the_graph_sizes_up_to_max_num_seqs():
    assert decode_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_batch_sizes(5) == [1, 2, 4, 5]
    assert decode_batch_sizes(1) == [1]


def test_context_buckets_reach_twice_the_longest_prefill_chunk_within_max_model_len():
    assert warm_up_module.context_buckets(32768, 2048) == [512, 1024, 2048, 4096]
    assert warm_up_module.context_buckets(1024, 8192) == [512, 1024]
    assert warm_up_module.context_buckets(4096, 200) == []
    assert warm_up_module.context_buckets(300, 2048) == []


def test_random_prompts_avoid_special_and_image_tokens_and_differ():
    engine = type("Engine", (), {})()
    engine.model_config = type("Config", (), {"vocab_size": 12, "image_token_id": 11})()
    engine.tokenizer = type("Tokenizer", (), {"all_special_ids": list(range(8))})()  # only 8, 9, 10 are left
    prompts = _RandomPrompts(engine)
    drawn = [prompts.prompt(20)["prompt_token_ids"] for _ in range(3)]
    assert {t for ids in drawn for t in ids} <= {8, 9, 10} and all(len(ids) == 20 for ids in drawn)
    assert len({tuple(ids) for ids in drawn}) == 3


def test_warm_up_runs_its_sweep_and_leaves_no_trace(monkeypatch):
    """Every prompt length and decode batch size is run, in every context bucket (with drafts: the speculative
    steps too); afterwards the counters a client reads are zero, nothing is left running, and outputs equal a fresh
    engine's."""
    pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")
    from deepinfer import SamplingParams

    from deepinfer.runner import cuda_graphs

    monkeypatch.setattr(warm_up_module, "PREFILL_TOKENS", (5, 70, 300))
    monkeypatch.setattr(warm_up_module, "context_buckets", lambda *limits: [512])  # one more bucket, on a CPU
    shapes = set()  # (padded rows, context bucket) of every padded decode step
    real_shape = cuda_graphs.DecodeGraphs._shape

    def shape(graphs, scheduled, tail=None):
        padded = real_shape(graphs, scheduled, tail)
        shapes.add((padded.num_tokens, padded.blocks * graphs.builder.layout.block_size))
        return padded

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_shape", shape)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = _embedded(enable_mtp_varlen=True)
    assert llm.engine.overlap is not None
    batches = []
    real_generate = llm.generate
    speculator = llm.engine.speculator
    choices = speculator.policy_choices
    assert choices == (0, speculator.max_drafts)  # padded steps: plain or every draft
    monkeypatch.setattr(llm, "generate", lambda prompts, p, use_tqdm: batches.append(
        ([len(x["prompt_token_ids"]) for x in prompts], speculator.policy_choices))
        or real_generate(prompts, p, use_tqdm=use_tqdm))
    done = warm_up(llm)
    assert done["prefill_tokens"] == [5, 70, 300] and done["decode_batch_sizes"] == [1, 2, 3]
    assert done["context_buckets"] == [256, 512]
    # the decode sweep once for each length the measured policy chooses from, the policy held to it, in each
    # context bucket: the larger one's batches share a prompt of half the bucket
    decode = [[5], [5, 5], [5, 5, 5]]
    longer = [[256], [256, 256], [256, 256, 256]]
    assert batches == ([([5], choices), ([70], choices), ([300], choices)]
                       + [(b, (0,)) for b in decode + longer]
                       + [(b, (speculator.max_drafts,)) for b in decode + longer])
    rows = (1, 1 + speculator.max_drafts)  # plain steps' rows a request, verification steps'
    assert {(n * q, c) for n in (1, 2, 3) for q in rows for c in (256, 512)} <= shapes
    assert speculator.policy_choices == choices
    booked = {k for (_, k) in speculator.policy.costs}
    assert booked == set(choices)
    # the costs stay, the made-up text's acceptance does not: the policy starts the first run from its prior
    prior = DraftPolicy(speculator.max_drafts)
    assert speculator.policy.acceptance_counts() == prior.acceptance_counts()
    counters = llm.engine.counters()
    assert counters["steps"] == counters["prompt_tokens"] == counters["finished_requests"] == 0
    assert counters["num_drafts"] == 0 and counters["running"] == counters["waiting"] == 0
    assert llm.engine.step_metrics.steps == 0
    monkeypatch.undo()
    fresh = _embedded(enable_mtp_varlen=True)
    assert ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, params, use_tqdm=False)])


def test_warm_up_runs_where_asked_and_by_default_on_a_gpu(monkeypatch):
    ran = []
    monkeypatch.setattr(warm_up_module, "warm_up", ran.append)
    for device, drafts, wanted, runs in (("cpu", None, None, False), ("cuda", None, None, True),
                                         ("cpu", None, True, True), ("cuda", None, False, False),
                                         ("cuda", "drafter", None, True), ("cuda", "drafter", False, False)):
        llm = type("LLM", (), {})()
        llm.engine = type("Engine", (), {"device": torch.device(device), "speculator": drafts})()
        ran.clear()
        warm_up_server(llm, wanted)
        assert bool(ran) == runs, (device, drafts, wanted)


def test_both_servers_take_the_flag(monkeypatch):
    """``--warm-up`` / ``--no-warm-up`` (default None: on a GPU) reach the engine's process and the thread's
    server alike."""
    from deepinfer.cli import serve as cli
    from deepinfer.serve import engine_process, launch

    pytest.importorskip("fastapi")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for flags, wanted in (([], None), (["--warm-up"], True), (["--no-warm-up"], False)):
        args = parser.parse_args(["--model", MODEL, *flags])
        assert args.warm_up is wanted
        loop, _ = launch.build(args)
        assert isinstance(loop, engine_process.EngineProcess) and loop._order[-1] is wanted
    seen = []
    monkeypatch.setattr("deepinfer.engine.warm_up.warm_up", lambda llm: seen.append(llm))
    loop, _ = launch.build(parser.parse_args(["--model", MODEL, "--dtype", "float32", "--no-engine-process",
                                              "--warm-up"]))
    assert seen == [loop.llm]
