"""Parallelism on 2 CPU processes (Gloo): data parallelism, expert parallelism (with speculative decoding too) and
EPLB give one process's greedy outputs; spawned ranks and torchrun ranks; a failing rank ends the job with its
error."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import counting_exchange_plugin
import parallel_fault_plugin
from deepinfer import LLM, SamplingParams, envs
from deepinfer.engine.config import EngineConfig
from deepinfer.parallel.context_parallel import zigzag_owners
from deepinfer.parallel.ranks import Ranks
from deepinfer.plugins.manager import load_plugins, pm, registered

TESTS = Path(__file__).parent
ROOT = TESTS.parent
# different lengths, so ranks finish at different steps and an idle rank must keep serving its experts; long
# prompts, so with a 16-token step budget their prefill is chunked, and one past 128 tokens (a ratio-128 entry;
# greedy margins >= 0.15 nats: V4.1's FP8/NVFP4 cache rounding turns float noise from other batch mates into
# visible logit steps, so a near-tie would flip with the batch, which is not what these tests are about)
PROMPTS = ["import os\n", "class Stack:", '"""Return the', "def main():\n    x = [",
           "import sys\nimport time\nimport json\n\n\ndef parse(argv):\n    parser = argparse.ArgumentParser()\n",
           "".join(f"import {module}\n" for module in (
               "os sys time json math random shutil string struct socket logging argparse tempfile threading "
               "subprocess collections functools itertools contextlib dataclasses traceback warnings weakref pathlib "
               "typing enum copy glob hashlib heapq io inspect operator pickle platform queue re select signal "
               "sqlite3 statistics textwrap unittest uuid zlib").split())]
MAX_TOKENS = [14, 6, 10, 4, 8, 6]
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=16)
MODES = {
    "data": dict(data_parallel_size=2),
    # every rank computes a zigzag share of every step's tokens
    "context": dict(context_parallel_size=2),
    "expert": dict(data_parallel_size=2, enable_expert_parallel=True),
    # rebalanced every 4 steps, with 2 replicas: weights move between ranks several times during generation
    "eplb": dict(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=2,
                 eplb_step_interval=4),
}


def _params():
    return [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=["v4.1", "v4"])
def model_and_reference(request, tiny_v4_checkpoint):
    model = "deepinfer-tiny-v4.1" if request.param == "v4.1" else str(tiny_v4_checkpoint)
    return model, _tokens(LLM(model, **ENGINE).generate(PROMPTS, _params(), use_tqdm=False))


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_give_one_process_greedy_outputs(model_and_reference, mode):
    model, reference = model_and_reference
    with LLM(model, **ENGINE, **MODES[mode]) as llm:
        outputs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        assert [o.request_id for o in outputs] == [str(i) for i in range(len(PROMPTS))]
        assert _tokens(outputs) == reference
        ep = llm.engine.expert_parallel
        if mode in ("data", "context"):
            assert ep is None
        else:
            assert ep.placement.slots_per_rank == (llm.engine.model_config.n_routed_experts
                                                   + MODES[mode].get("num_redundant_experts", 0)) // 2
            assert ep.exchange_time.total() > 0
        if mode == "eplb":  # the weights moved, and the refitted placements balance better than the static split
            assert ep.swaps >= 1
            assert min(b.refitted for b in ep.balancedness) < max(b.static for b in ep.balancedness)
        # a second call on the same ranks: the job keeps serving
        assert _tokens(llm.generate(PROMPTS[:3], _params()[:3], use_tqdm=False)) == reference[:3]


@pytest.mark.parametrize("mode", ["expert", "eplb"])
def test_expert_parallel_ranks_speculate_and_keep_greedy_outputs(model_and_reference, mode, monkeypatch):
    """Drafts on expert-parallel ranks: each rank drafts for its own requests (the draft stages' experts are not
    split, so a draft pass needs no exchange), and every verification step runs the target's exchanges on every
    rank as any step does. Greedy outputs stay one process's without drafts."""
    model, reference = model_and_reference
    if model != "deepinfer-tiny-v4.1":
        pytest.skip("the tiny V4 checkpoint has no MTP layer; the embedded V4.1 model has DSpark stages")
    mtp = pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")  # the spawned rank inherits it
    envs.reload()
    with registered(mtp, "mtp"), LLM(model, **ENGINE, **MODES[mode]) as llm:
        assert llm.engine.speculator is not None
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == reference
        assert llm.engine.counters()["num_drafts"] > 0  # rank 0 verified drafts
        if mode == "eplb":  # experts moved between ranks while drafts were verified
            assert llm.engine.expert_parallel.swaps >= 1


def test_context_parallel_ranks_refuse_speculative_decoding(monkeypatch):
    mtp = pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    envs.reload()
    with registered(mtp, "mtp"), pytest.raises(ValueError, match="speculative decoding with context_parallel_size"):
        LLM("deepinfer-tiny-v4.1", **ENGINE, **MODES["context"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL between them)")
@pytest.mark.parametrize("mode", MODES)
def test_two_gpus_give_one_gpu_greedy_outputs(mode):
    engine = {**ENGINE, "device": "cuda"}
    reference = _tokens(LLM("deepinfer-tiny-v4.1", **engine).generate(PROMPTS, _params(), use_tqdm=False))
    with LLM("deepinfer-tiny-v4.1", **engine, **MODES[mode]) as llm:
        assert llm.engine.device == torch.device("cuda", 0)
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == reference
        if mode == "eplb":
            assert llm.engine.expert_parallel.swaps >= 1


def test_hook_deepinfer_token_exchange():
    load_plugins()
    pm.register(counting_exchange_plugin, name="counting_exchange_plugin")
    prompts, params = PROMPTS[:3], _params()[:3]
    reference = _tokens(LLM("deepinfer-tiny-v4.1", **ENGINE).generate(prompts, params, use_tqdm=False))
    with LLM("deepinfer-tiny-v4.1", **ENGINE, **MODES["expert"]) as llm:
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
        exchange = llm.engine.expert_parallel.exchange
        assert exchange.name == "counting-all-to-all"
        # one dispatch and one combine per MoE layer per step, idle steps included
        assert exchange.dispatches == exchange.combines == llm.engine.expert_parallel.steps * 9


def test_a_spawned_rank_that_fails_ends_the_job_with_its_error():
    load_plugins()
    pm.register(parallel_fault_plugin, name="parallel_fault_plugin")
    llm = LLM("deepinfer-tiny-v4.1", **ENGINE, **MODES["expert"])
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed") as failure:
        llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert parallel_fault_plugin.MESSAGE in str(failure.value)
    assert not llm.ranks.workers  # ended, not left waiting for calls


def test_a_spawned_rank_that_dies_ends_the_job():
    llm = LLM("deepinfer-tiny-v4.1", **ENGINE, **MODES["data"])
    worker = llm.ranks.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*exited with code -9"):
        llm.generate(PROMPTS, _params(), use_tqdm=False)


def _torchrun(tmp_path, *args, check=True):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(TESTS / "torchrun_generate.py"), "deepinfer-tiny-v4.1", str(out), *args],
                         env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert run.returncode == 0, run.stderr[-3000:]
    return run, out


def test_torchrun_ranks_each_return_every_output(tmp_path):
    reference = _tokens(LLM("deepinfer-tiny-v4.1", device="cpu", dtype="float32").generate(
        ["import os\n", "class Stack:", '"""Return the', "def main():\n    x = [", "for i in range(10):"],
        SamplingParams(temperature=0, max_tokens=12), use_tqdm=False))
    _, out = _torchrun(tmp_path, "--expert-parallel")
    for rank in (0, 1):
        result = json.loads(Path(f"{out}.{rank}.json").read_text())
        assert result["tokens"] == reference
        # each rank passed its own prompt: refused on both ranks, naming the difference
        assert "differs between ranks" in result["mismatch"]


def test_torchrun_rank_that_fails_ends_every_rank(tmp_path):
    run, _ = _torchrun(tmp_path, "--fault", "--expert-parallel", check=False)
    assert run.returncode != 0
    assert parallel_fault_plugin.MESSAGE in run.stderr


def test_zigzag_gives_each_rank_early_and_late_tokens_of_a_prefill():
    owners = zigzag_owners([8, 1, 1, 1, 5], 2)
    # 8 tokens in 4 pieces: rank 0 takes the first and last, rank 1 the middle two; short runs are dealt in turn
    assert owners[:8] == [0, 0, 1, 1, 1, 1, 0, 0]
    assert owners[8:11] == [0, 1, 0]
    assert owners[11:] == [0, 1, 1, 0, 0]  # 5 tokens: pieces of 1, 1, 1, 2
    for ranks in (2, 3, 4):  # a long prefill's causal work (sum of positions + 1) splits evenly
        owners = zigzag_owners([4096], ranks)
        work = [sum(p + 1 for p, o in enumerate(owners) if o == r) for r in range(ranks)]
        assert max(work) / min(work) < 1.01


@pytest.mark.parametrize("args, problem", [
    (dict(enable_eplb=True), "enable_eplb=True needs enable_expert_parallel=True"),
    (dict(num_redundant_experts=2, enable_expert_parallel=True), "needs enable_eplb=True"),
    (dict(data_parallel_size=0), "data_parallel_size must be an integer >= 1"),
    (dict(enable_expert_parallel="yes"), "enable_expert_parallel must be True or False"),
    (dict(context_parallel_size=2, data_parallel_size=2), "context_parallel_size > 1 runs alone"),
])
def test_bad_parallel_arguments_are_refused(args, problem):
    with pytest.raises(ValueError, match=problem):
        EngineConfig(**args)


def test_expert_parallel_needs_ranks():
    with pytest.raises(ValueError, match="needs more than one rank"):
        LLM("deepinfer-tiny-v4.1", device="cpu", enable_expert_parallel=True)


def test_experts_must_divide_over_the_ranks():
    # 8 experts + 1 replica cannot be split evenly over 2 ranks
    with pytest.raises(ValueError, match="divide evenly by 2"):
        LLM("deepinfer-tiny-v4.1", **ENGINE, **{**MODES["eplb"], "num_redundant_experts": 1})


def test_a_spawned_rank_makes_only_the_calls_it_serves(monkeypatch):
    """Rank 0 mirrors a call by its name; a spawned rank looks it up in its table of calls, never by attribute."""
    said = iter([("generate", (1, 2)), ("_generate_on_ranks", ()), ("close", ())])
    monkeypatch.setattr(Ranks, "_broadcast", lambda self, obj=None: next(said))
    ranks, made = Ranks(1, 2, 1, torch.device("cpu"), None, None), []
    with pytest.raises(RuntimeError, match="mirrored '_generate_on_ranks', which a spawned rank does not serve"):
        ranks.serve({"generate": lambda *args: made.append(args)})
    assert made == [(1, 2)]
