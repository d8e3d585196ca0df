"""DeepSeek-V4's classic MTP drafter (``models/deepseek_v4/mtp.py``, served by ``features/mtp``): its drafts against
a dense recompute from every target feature the run produced, lossless output, refusals and CUDA graphs."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams, envs
from deepinfer.plugins.manager import PluginError, registered
from deepinfer.testing.oracle_drafts import WatchingPlugin
from deepinfer.testing.tiny_v4 import add_mtp_layer, build_tiny_v4

pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")

DRAFTS = 3
# the second prompt outgrows the 64-row window of the tiny model, so rows wrap around the ring
PROMPTS = [[5, 9, 13, 20, 7], [(i * 7) % 250 + 3 for i in range(70)]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return add_mtp_layer(build_tiny_v4(tmp_path_factory.mktemp("tiny_v4_mtp")))


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", str(DRAFTS))
    envs.reload()


def _llm(checkpoint, plugin=None, **engine_args) -> LLM:
    with registered(plugin or importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        return LLM(str(checkpoint), dtype="float32", **engine_args)


def _dense_drafts(model, layer, features: dict[int, torch.Tensor], token_ids: list[int]):
    """Draft tokens and logits recomputed from scratch: every window row from the target's streams at its
    position (``features``) and the next token, then the chain with plain softmax attention (with sinks) over the
    last ``window`` rows, the chain's own rows included."""
    c, device = model.config, model.embed.weight.device
    anchor = len(token_ids) - 2
    streams = torch.stack([features[p] for p in range(anchor + 1)]).view(anchor + 1, c.hc_mult, c.hidden_size)
    phases = model.rotary_main.phases(torch.arange(anchor + 1, device=device))
    next_tokens = torch.tensor(token_ids[1:anchor + 2], device=device)
    rows = list(layer.window_rows(layer.mix(model.embed(next_tokens), streams), phases))
    state, token, tokens, logits = streams[anchor:], torch.tensor(token_ids[-1:], device=device), [], []
    attn = layer.attn
    for step in range(DRAFTS):
        at = anchor + step
        phase = model.rotary_main.phases(torch.tensor([at], device=device))
        mixed = layer.mix(model.embed(token), state)
        x, post, comb = layer.hc_attn.collapse(mixed, layer.attn_norm)
        own = attn.keys(attn.wkv(x), phase)[0]
        rows = rows[:at] + [own]  # the chain's rows replace whatever stood at its positions
        window = torch.stack(rows[max(0, at - c.window + 1):])  # [K, D]
        q, _ = attn.queries(attn.wq_a(x), phase)  # [1, H, D]
        scores = torch.einsum("hd,kd->hk", q[0].float(), window.float()) * attn.scale
        weights = torch.softmax(torch.cat([scores, attn.attn_sink.float().unsqueeze(1)], dim=1), dim=1)[:, :-1]
        o = torch.einsum("hk,kd->hd", weights, window.float()).to(x.dtype).unsqueeze(0)
        state = layer.hc_attn.expand(mixed, attn.output(o, phase), post, comb)
        x, post, comb = layer.hc_ffn.collapse(state, layer.ffn_norm)
        state = layer.hc_ffn.expand(state, layer.ffn(x, None), post, comb)
        step_logits = model.project_vocab(layer.final_hidden(state))[0]
        token = step_logits.argmax().view(1)
        tokens.append(int(token))
        logits.append(step_logits)
    return tokens, torch.stack(logits)


def test_drafts_match_a_dense_recompute_at_every_step(mtp_checkpoint):
    """Each step's drafts and their logits equal a recompute from the target's streams at every position so far:
    the ring's rows per position, its wrap-around, the rows a rejected chain left behind, and the chain's reuse of
    its own output streams all come out as the reference MTP block computes them."""
    features: dict[int, dict[int, torch.Tensor]] = {}  # id(request) -> position -> target streams
    checked, recorded = [], []

    def recording(context):  # the drafter's vocabulary projections, as it makes them
        return replace(context, project_vocab=lambda hidden: recorded.append(context.project_vocab(hidden))
                       or recorded[-1])

    def spy(propose, requests, computed, step_features):
        for c in computed:
            rows = step_features[c.row:c.row + c.count]
            features.setdefault(id(c.request), {}).update({c.position + i: rows[i].clone() for i in range(c.count)})
        recorded.clear()
        drafts = propose(requests, computed, step_features)
        drafter = propose.__self__
        for i, (request, draft) in enumerate(zip(requests, drafts)):
            tokens, logits = _dense_drafts(model, drafter.layer, features[id(request)], request.token_ids)
            engine_logits = torch.stack([step[i] for step in recorded])
            assert draft.token_ids == tokens
            assert torch.allclose(engine_logits, logits, rtol=1e-4, atol=1e-4 * logits.abs().max())
            checked.append(len(request.token_ids))
        return drafts

    llm = _llm(mtp_checkpoint, WatchingPlugin(importlib.import_module("deepinfer_mtp.plugin"), recording,
                                              propose=spy))
    model = llm.engine.model
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(checked) >= 2 * 6 and max(checked) > model.config.window


def test_greedy_and_seeded_output_is_unchanged(mtp_checkpoint, monkeypatch):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seq_seed=7, max_tokens=12, ignore_eos=True)
    drafted = _llm(mtp_checkpoint)
    outputs = [drafted.generate(PROMPTS, params, use_tqdm=False) for params in (GREEDY, seeded)]
    assert drafted.engine.speculator.stats.num_draft_tokens > 0
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN")
    envs.reload()
    plain = LLM(str(mtp_checkpoint), dtype="float32")
    assert plain.engine.speculator is None
    for params, drafted_outputs in zip((GREEDY, seeded), outputs):
        expected = plain.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in drafted_outputs] == [o.outputs[0].token_ids for o in expected]


def test_checkpoints_without_an_mtp_layer_are_refused(tiny_v4_checkpoint, mtp_checkpoint):
    with pytest.raises(PluginError, match="no MTP layer"):
        _llm(tiny_v4_checkpoint)
    with pytest.raises(PluginError, match="load_format='dummy'"):
        _llm(mtp_checkpoint, load_format="dummy")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_mtp_chain_replays_from_cuda_graphs_as_it_runs_eagerly(mtp_checkpoint):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed
    nvidia = pytest.importorskip("deepinfer_nvidia.plugin")
    with registered(nvidia, "nvidia"):
        llm = _llm(mtp_checkpoint)
        eager = _llm(mtp_checkpoint, enforce_eager=True).generate(PROMPTS, GREEDY, use_tqdm=False)
    drafter = llm.engine.speculator.drafter
    assert llm.engine.graphs is not None and drafter.graphs is not None
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in eager]
    assert drafter.graphs.graphs, "no draft chain was captured"
    inputs = torch.tensor([[11, 12], [4, 60], [0, 1]])
    size = next(s for s in drafter.graphs.sizes if s >= 2)
    padded = torch.zeros(3, size, dtype=torch.int64)
    padded[2] = drafter.pool.empty
    padded[:, :2] = inputs
    with torch.inference_mode():  # as the engine runs it: the pool and the graph's inputs are inference tensors
        replayed = drafter.graphs(drafter._draft, inputs)[0].clone()
        assert torch.equal(replayed, drafter._draft(padded.cuda())[0][:2])
