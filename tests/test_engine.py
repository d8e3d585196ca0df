"""The engine end to end on a tiny checkpoint: API behaviour, hooks, errors."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.plugins import hookimpl
from deepinfer.plugins.builtin.torch_attention import TorchAttention
from deepinfer.plugins.builtin.torch_mhc import TorchMHC
from deepinfer.plugins.builtin.torch_moe import TorchMoE
from deepinfer.plugins.manager import registered

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_v4_checkpoint):
    return LLM(str(tiny_v4_checkpoint), dtype="float32")


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


class CountingAttention(TorchAttention):
    name = "counting-attention"
    calls = 0

    def sparse_attention(self, *args):
        CountingAttention.calls += 1
        return super().sparse_attention(*args)


class CountingMoE(TorchMoE):
    name = "counting-moe"
    calls = 0

    def routed_experts(self, *args):
        CountingMoE.calls += 1
        return super().routed_experts(*args)


class AttentionPlugin:
    @hookimpl
    def deepinfer_attention_backend(self, config, device):
        return CountingAttention()


class MoEPlugin:
    @hookimpl
    def deepinfer_moe_backend(self, config, device):
        return CountingMoE()


def test_hook_deepinfer_attention_backend(tiny_v4_checkpoint, llm, caplog):
    expected = _tokens(llm, ["def f(x):"])
    with registered(AttentionPlugin(), "counting"):
        replaced = LLM(str(tiny_v4_checkpoint), dtype="float32")
        assert _tokens(replaced, ["def f(x):"]) == expected
    assert CountingAttention.calls > 0
    assert "attention backend: counting-attention (plugin counting)" in caplog.text


def test_hook_deepinfer_moe_backend(tiny_v4_checkpoint, llm, caplog):
    expected = _tokens(llm, ["import os"])
    with registered(MoEPlugin(), "counting"):
        assert _tokens(LLM(str(tiny_v4_checkpoint), dtype="float32"), ["import os"]) == expected
    assert CountingMoE.calls > 0
    assert "moe backend: counting-moe (plugin counting)" in caplog.text


class CountingMHC(TorchMHC):
    name = "counting-mhc"
    calls = 0

    def coefficients(self, *args):
        CountingMHC.calls += 1
        return super().coefficients(*args)


class MHCPlugin:
    @hookimpl
    def deepinfer_mhc_backend(self, config, device):
        return CountingMHC()


def test_hook_deepinfer_mhc_backend(tiny_v4_checkpoint, llm, caplog):
    expected = _tokens(llm, ["import os"])
    with registered(MHCPlugin(), "counting"):
        assert _tokens(LLM(str(tiny_v4_checkpoint), dtype="float32"), ["import os"]) == expected
    assert CountingMHC.calls > 0
    assert "mhc backend: counting-mhc (plugin counting)" in caplog.text


class Offers:
    @hookimpl
    def deepinfer_drafter(self, config, context):
        # drafts nothing: what a drafter's drafts do is tests/test_speculative_decoding.py's
        return type("Drafter", (), {"name": "test-drafter", "propose": lambda self, requests, computed, features: []})()

    @hookimpl
    def deepinfer_prefill_truncation(self, config, model_config):
        return type("Truncation", (), {"name": "test-truncation", "replay_start": lambda self, prompt_tokens: 0})()

    @hookimpl
    def deepinfer_logits_processor(self, config, tokenizer, vocab_size):
        return EvenTokens(vocab_size)


class EvenTokens:
    """A grammar of three even token ids, then the end: what the hook's processor and matchers must do."""

    name = "even-tokens"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def validate(self, so_args):
        if so_args["schema"] != "even":
            raise ValueError("only the 'even' grammar")

    def matcher(self, so_args):
        return EvenMatcher()


class EvenMatcher:
    def __init__(self):
        self.accepted = 0

    @property
    def terminated(self) -> bool:
        return self.accepted == 3

    def fill_mask(self, bitmask, row):
        bitmask[row] = 0x55555555  # bits 0, 2, 4, ...: the even tokens

    def accept(self, token_id):
        self.accepted += token_id % 2 == 0
        return token_id % 2 == 0


def test_hook_deepinfer_drafter(tiny_v4_checkpoint):
    class DrafterOnly:
        deepinfer_drafter = Offers.deepinfer_drafter

    with registered(DrafterOnly(), "drafts"):
        llm = LLM(str(tiny_v4_checkpoint), dtype="float32")
    assert llm.engine.speculator.drafter.name == "test-drafter"  # what it drafts: tests/test_speculative_decoding.py


def test_hook_deepinfer_prefill_truncation(tiny_v4_checkpoint):
    class TruncationOnly:
        deepinfer_prefill_truncation = Offers.deepinfer_prefill_truncation

    with registered(TruncationOnly(), "yoco"), pytest.raises(ValueError, match="plugin yoco offers prefill truncation"):
        LLM(str(tiny_v4_checkpoint), dtype="float32")


def test_hook_deepinfer_logits_processor(llm):
    params = SamplingParams(so_args={"schema_type": "regex", "schema": "[a-z]+"})
    with pytest.raises(ValueError, match="deepinfer-structured-outputs"):
        llm.generate(["x"], params, use_tqdm=False)

    class GrammarOnly:
        deepinfer_logits_processor = Offers.deepinfer_logits_processor

    with registered(GrammarOnly(), "grammar"):
        with pytest.raises(ValueError, match="only the 'even' grammar"):
            llm.generate(["x"], params, use_tqdm=False)
        even = SamplingParams(temperature=1.0, max_tokens=10, so_args={"schema_type": "regex", "schema": "even"})
        outputs = llm.generate(["x", "y"], [even, SamplingParams(max_tokens=4)], use_tqdm=False)
    tokens = outputs[0].outputs[0].token_ids
    assert len(tokens) == 3 and all(t % 2 == 0 for t in tokens) and outputs[0].outputs[0].finish_reason == "stop"
    assert len(outputs[1].outputs[0].token_ids) == 4


def test_outputs_in_input_order_with_token_id_prompts(llm):
    prompts = ["a", [0, 5, 6, 7], "class Foo:"]
    alone = [_tokens(llm, [p])[0] for p in prompts]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert outputs[1].prompt is None and outputs[1].prompt_token_ids == [0, 5, 6, 7]
    assert outputs[0].prompt == "a" and outputs[0].prompt_token_ids[0] == 0  # BOS
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)


def test_n_samples_and_seeded_sampling(llm):
    params = SamplingParams(temperature=1.0, n=3, max_tokens=8, seq_seed=1234, ignore_eos=True)
    first = llm.generate(["hello"], params, use_tqdm=False)[0]
    again = llm.generate(["x", "hello"], [params, params], use_tqdm=False)[1]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_stop_string_and_stop_token(llm):
    free = llm.generate(["def f(x):"], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[3:6]
    cut = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[: free.text.index(stop)]
    token = free.token_ids[4]
    by_token = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
    assert by_token.stop_reason == token and by_token.token_ids == free.token_ids[: free.token_ids.index(token) + 1]


def test_logprobs(llm):
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, step in zip(out.token_ids, out.logprobs):
        assert step[token].rank == 1 and len(step) == 3
    assert out.cumulative_logprob == pytest.approx(sum(step[t].logprob for t, step in zip(out.token_ids, out.logprobs)))
    # not asked for: neither is kept (as in vLLM), and the sampler skips the vocabulary softmax; same tokens
    plain = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].logprobs is None and plain[0].outputs[0].cumulative_logprob is None
    assert plain[0].outputs[0].token_ids == out.token_ids


def test_sampler_skips_logprobs_nobody_asked_for():
    from deepinfer.runtime.request import Request
    from deepinfer.runner.sampling_batch import build_sampling_batch
    from deepinfer.plugins.builtin.torch_sampler import TorchSampler

    logits = torch.randn(2, 50)
    def request(params):
        return Request("r", 0, None, [1, 2], params, eos_token_ids=(0,))

    requests = [request(SamplingParams(temperature=0)), request(SamplingParams(temperature=0))]
    quiet = build_sampling_batch([(r, 0) for r in requests], 50, "cpu")
    assert not quiet.any_logprobs and TorchSampler().sample(logits, quiet).logprobs is None
    requests[1] = request(SamplingParams(temperature=0, logprobs=0))
    asked = TorchSampler().sample(logits, build_sampling_batch([(r, 0) for r in requests], 50, "cpu"))
    assert torch.allclose(asked.logprobs, logits.log_softmax(-1).max(-1).values)


def test_bad_input_errors_name_the_problem(llm, tiny_v4_checkpoint):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[0, 99999]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 2000], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tiny_v4_checkpoint), max_num_seq=4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(str(tiny_v4_checkpoint), dtype="fp33")


def test_hook_deepinfer_step_context(tiny_v4_checkpoint):
    """Every step runs inside each plugin's context, entered and left once per step."""
    events = []

    class Recorder:
        name = "recorder"

        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    class StepContext:
        @hookimpl
        def deepinfer_step_context(self, config, device):
            return Recorder()

    with registered(StepContext(), "step-context"):
        llm = LLM(str(tiny_v4_checkpoint), dtype="float32")
    llm.generate(["a", "b c"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    steps = llm.engine.step_metrics.steps
    assert steps > 0 and events.count("enter") >= steps and events == ["enter", "exit"] * (len(events) // 2)


@pytest.mark.parametrize(
    "variable, value, distribution",
    [
        ("DEEPINFER_ENABLE_MTP_VARLEN", "1", "deepinfer-mtp"),
        ("DEEPINFER_ENABLE_MTP_VARLEN", "0", "deepinfer-mtp"),  # fixed-length speculation: still needs the plugin
        ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact", "deepinfer-swa-replay"),
        ("DEEPINFER_BATCH_INVARIANT", "1", "deepinfer-batch-invariant"),
    ],
)
def test_feature_switch_without_its_plugin_is_an_error(tiny_v4_checkpoint, monkeypatch, variable, value, distribution):
    from deepinfer import envs

    monkeypatch.setenv(variable, value)
    envs.reload()
    with pytest.raises(ValueError, match=f"{variable}={value} needs the {distribution} plugin"):
        LLM(str(tiny_v4_checkpoint), dtype="float32")


def test_engine_counters_add_up(tiny_v4_checkpoint, caplog):
    llm = LLM(str(tiny_v4_checkpoint), dtype="float32", num_cache_tokens=256, block_size=16)
    prompts = [list(range(3, 60)), list(range(3, 60)), [5] * 30]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    counters = llm.engine.counters()
    assert counters["prompt_tokens"] == sum(map(len, prompts))
    assert counters["generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outputs) == 60
    assert counters["finished_requests"] == 3 and counters["running"] == counters["waiting"] == 0
    assert counters["cached_prompt_tokens"] == sum(o.metrics.num_cached_tokens for o in outputs)
    assert counters["preemptions"] == llm.engine.scheduler.num_preemptions
    assert counters["steps"] >= 20 and set(counters["cache_usage"]) and all(
        0 <= used <= 1 for used in counters["cache_usage"].values())
    assert "generate: 3 prompts, 144 prompt tokens, 60 generated" in caplog.text


def test_the_model_runner_returns_the_sampled_rows_logits(tiny_v4_checkpoint):
    """The step contract end to end: the scheduler's rows (who samples decided once), the runner's typed result,
    the scheduler's booking."""
    from deepinfer.runner.model_runner import ForwardOutput

    llm = LLM(str(tiny_v4_checkpoint), dtype="float32", max_num_batched_tokens=8)
    for prompt in ([5, 6, 7], list(range(3, 15))):
        llm.submit(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine = llm.engine
    scheduled = engine.scheduler.schedule()
    assert [(row.start, row.count, row.samples) for row in scheduled] == [(0, 3, True), (0, 5, False)]
    forward = engine.runner.forward(scheduled)
    assert isinstance(forward, ForwardOutput)
    assert forward.logits.shape == (1, engine.model_config.vocab_size)  # the first request's last prompt token
    engine.scheduler.update(scheduled)
    assert [r.num_computed for r in scheduled.requests] == [3, 5]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_step_mode_follows_the_configuration(tiny_v4_checkpoint, asynchronous):
    from deepinfer.engine.steps import DecodeSteps

    llm = LLM(str(tiny_v4_checkpoint), dtype="float32", async_scheduling=asynchronous)
    assert type(llm.engine.steps) is DecodeSteps and llm.engine.steps.asynchronous is asynchronous
    assert llm.engine.overlap is None and not llm.engine.steps.in_flight


def test_close_frees_the_engine_and_refuses_later_calls(tiny_v4_checkpoint):
    """``close()`` (the end of a with block) drops the engine now, not at a later collection, and a call after it
    is an error saying so rather than an AttributeError."""
    import weakref

    with LLM(str(tiny_v4_checkpoint), dtype="float32", device="cpu") as llm:
        model = weakref.ref(llm.engine.model)
        assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert model() is None
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()  # twice is harmless
