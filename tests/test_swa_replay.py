"""SWA bounded replay (``features/swa_replay``, ``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact``): DeepSeek-V4.1's
window-only decoder layers prefill each prompt's last ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`` tokens."""

from __future__ import annotations

import importlib

import pytest
import torch

from deepinfer import LLM, SamplingParams, envs
from deepinfer.plugins.manager import registered

pytest.importorskip("deepinfer_swa_replay.plugin", reason="features/swa_replay is not installed (build.sh installs it)")

KEEP = 70  # the embedded model's window is 64
# fp32 with dequantized weights: equal inputs give equal outputs whatever the batch's shape
EXACT = dict(dtype="float32", quantization="none", enable_prefix_caching=False)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def text_ids():
    from deepinfer.loading.model_source import EMBEDDED_MODEL_DIR
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    return tokenizer.encode(open(__file__).read())


def _llm(mode: str, monkeypatch, keep: int = KEEP, model="deepinfer-tiny-v4.1", **engine_args) -> LLM:
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", mode)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", str(keep))
    envs.reload()
    with registered(importlib.import_module("deepinfer_swa_replay.plugin"), "swa_replay"):
        return LLM(str(model), **{**EXACT, **engine_args})


def _decoder_rows(llm: LLM) -> list[tuple[int, int]]:
    """(rows into the last encoder layer, rows into the first decoder layer) of every forward pass."""
    model, seen = llm.engine.model, []
    first = model.layers[model.decoder_start]
    last_encoder = model.layers[model.decoder_start - 1]
    encoder_forward, decoder_forward = last_encoder.forward, first.forward

    def encoder(streams, *args, **kwargs):
        seen.append([streams.shape[0], 0])
        return encoder_forward(streams, *args, **kwargs)

    def decoder(streams, *args, **kwargs):
        seen[-1][1] = streams.shape[0]
        return decoder_forward(streams, *args, **kwargs)

    last_encoder.forward, first.forward = encoder, decoder
    return seen


def _same(a, b, logprobs_atol=0.0):
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for x, y in zip(a, b):
        for step_x, step_y in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert step_x.keys() == step_y.keys()
            for token in step_x:
                assert abs(step_x[token].logprob - step_y[token].logprob) <= logprobs_atol


def test_prompts_within_keep_tokens_are_exactly_full_prefill(text_ids, monkeypatch):
    prompts = [text_ids[:KEEP], text_ids[100:130]]
    full = _llm("off", monkeypatch).generate(prompts, GREEDY, use_tqdm=False)
    compact = _llm("compact", monkeypatch)
    rows = _decoder_rows(compact)
    _same(compact.generate(prompts, GREEDY, use_tqdm=False), full)
    assert rows[0] == [KEEP + 30, KEEP + 30]  # the prefill step: every row reached the decoder layers


def test_long_prompts_run_the_decoder_layers_on_their_suffix_only(text_ids, monkeypatch):
    """The decoder layers see each prompt's last KEEP rows in the prefill step, and every row of later steps;
    the encoder layers see everything. The output stays close to full prefill's on this trained model."""
    prompts = [text_ids[:300], text_ids[400:450], text_ids[500:700]]
    compact = _llm("compact", monkeypatch)
    rows = _decoder_rows(compact)
    outputs = compact.generate(prompts, GREEDY, use_tqdm=False)
    assert rows[0] == [550, KEEP + 50 + KEEP]
    assert all(encoder == decoder == 3 for encoder, decoder in rows[1:])
    assert [o.prompt_token_ids for o in outputs] == prompts
    full = _llm("off", monkeypatch).generate(prompts, GREEDY, use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == full[1].outputs[0].token_ids  # short: untouched
    differs = [abs(outputs[i].outputs[0].logprobs[0][t].logprob - full[i].outputs[0].logprobs[0][t].logprob)
               for i in (0, 2) for t in outputs[i].outputs[0].logprobs[0].keys() & full[i].outputs[0].logprobs[0].keys()]
    assert differs and max(differs) > 0  # truncation does change something on long prompts


def test_decoder_layers_never_read_rows_before_the_replay_start(text_ids, monkeypatch):
    """Every window row starts as a huge poison value: rows the run writes replace it, and a query reading an
    unwritten one (a decoder row before the replay start, left out of the suffix) would swamp its attention.
    The output is the unpoisoned run's, and the decoder's rows before the replay start are still poison."""
    prompts = [text_ids[:300], text_ids[400:450]]
    clean = _llm("compact", monkeypatch).generate(prompts, GREEDY, use_tqdm=False)
    llm = _llm("compact", monkeypatch, max_num_batched_tokens=128)
    model, cache = llm.engine.model, llm.engine.cache
    with torch.inference_mode():
        for layer in range(model.config.num_layers):
            cache.pool("swa", "kv", layer).fill_(1e4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _same(outputs, clean, logprobs_atol=1e-4)
    decoder_rows = cache.pool("swa", "kv", model.decoder_start)
    assert (decoder_rows == 1e4).all(dim=-1).sum() >= 300 - KEEP - model.config.window


@pytest.mark.parametrize("engine_args", [{"max_num_batched_tokens": 64}, {"max_num_batched_tokens": 100}],
                         ids=["chunks-of-64", "chunks-of-100"])
def test_chunked_and_batched_replays_match_one_request_in_one_step(text_ids, monkeypatch, engine_args):
    """The replay start holds across prefill chunks (chunks wholly before it skip the decoder layers; a chunk
    just after it still hides the rows before it from their windows) and per request in a mixed batch."""
    long_prompt, short_prompt = text_ids[:300], text_ids[400:440]
    alone = _llm("compact", monkeypatch).generate([long_prompt], GREEDY, use_tqdm=False)
    chunked = _llm("compact", monkeypatch, **engine_args)
    rows = _decoder_rows(chunked)
    _same(chunked.generate([long_prompt], GREEDY, use_tqdm=False), alone, logprobs_atol=1e-3)  # other GEMM shapes
    assert any(encoder and not decoder for encoder, decoder in rows)  # a chunk wholly before the replay start
    outputs = chunked.generate([short_prompt, long_prompt], GREEDY, use_tqdm=False)
    _same(outputs[1:], alone, logprobs_atol=1e-3)


def test_prefix_cache_reuses_no_window_rows_of_a_replayed_prefill(text_ids, monkeypatch):
    """A replayed prefill's window rows differ from a full one's, so they are not offered for reuse: the same
    prompt again computes the same result (here: from scratch), and a short prompt sharing its first block is
    still exact."""
    prompt = text_ids[:300]
    llm = _llm("compact", monkeypatch, enable_prefix_caching=True)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)
    _same(again, first, logprobs_atol=1e-5)
    short = text_ids[:KEEP]
    full = _llm("off", monkeypatch).generate([short], GREEDY, use_tqdm=False)
    _same(llm.generate([short], GREEDY, use_tqdm=False), full, logprobs_atol=1e-5)


def test_a_prefix_cache_hit_keeps_the_replay_start(text_ids, monkeypatch):
    """A long prompt whose first blocks a full (short) prefill cached starts from them and still replays its
    decoder layers from its own replay start: the result is the one without prefix caching."""
    short, long_prompt = text_ids[:KEEP], text_ids[:300]
    expected = _llm("compact", monkeypatch).generate([long_prompt], GREEDY, use_tqdm=False)
    llm = _llm("compact", monkeypatch, enable_prefix_caching=True)
    llm.generate([short], GREEDY, use_tqdm=False)  # no longer than keep-tokens: a full prefill, its blocks cached
    rows = _decoder_rows(llm)
    outputs = llm.generate([long_prompt], GREEDY, use_tqdm=False)
    assert outputs[0].metrics.num_cached_tokens >= 64
    assert rows[0] == [300 - outputs[0].metrics.num_cached_tokens, KEEP]
    _same(outputs, expected, logprobs_atol=1e-3)


def test_refusals_name_the_problem(tiny_v4_checkpoint, monkeypatch):
    with pytest.raises(ValueError, match=r"W=64 plus the longest backtrack B=0.*KEEP_TOKENS >= 64"):
        _llm("compact", monkeypatch, keep=63)
    with pytest.raises(ValueError, match="no window-only decoder layers"):
        _llm("compact", monkeypatch, model=tiny_v4_checkpoint)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "tail")
    with pytest.raises(ValueError, match="one of off, compact"):
        envs.reload()
    with pytest.raises(TypeError, match="prompt_logprobs"):  # no prompt logprobs in any mode (rows lack logits)
        SamplingParams(prompt_logprobs=1)


def test_the_suffix_must_also_cover_rolled_back_drafts(monkeypatch):
    """B is the longest rollback: with speculative decoding on, DEEPINFER_USE_NEXTN_DECODE drafts."""
    pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "5")
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        with pytest.raises(ValueError, match=r"W=64 plus the longest backtrack B=5.*KEEP_TOKENS >= 69"):
            _llm("compact", monkeypatch, keep=68)
        llm = _llm("compact", monkeypatch, keep=69)
    assert llm.engine.truncation is not None and llm.engine.speculator is not None


def test_engine_arguments_switch_it_as_the_variables_do(text_ids, monkeypatch):
    """``prefill_truncation_mode`` and ``prefill_keep_tokens`` are engine arguments whose defaults the variables
    fill: given as arguments they replay the same rows, whatever the environment says."""
    prompts = [text_ids[:300]]
    by_variables = _llm("compact", monkeypatch)
    expected = by_variables.generate(prompts, GREEDY, use_tqdm=False)
    with registered(importlib.import_module("deepinfer_swa_replay.plugin"), "swa_replay"):
        by_arguments = LLM("deepinfer-tiny-v4.1", prefill_truncation_mode="compact", prefill_keep_tokens=KEEP,
                           **EXACT)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "off")
    envs.reload()  # read once, when a config is built: later changes reach only later engines
    rows = _decoder_rows(by_arguments)
    _same(by_arguments.generate(prompts, GREEDY, use_tqdm=False), expected)
    assert by_arguments.engine.truncation is not None and rows[0] == [300, KEEP]
