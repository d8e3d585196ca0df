"""DeepSeek-V4.1's DSpark draft (``models/deepseek_v41/dspark.py``, served by ``features/mtp``) against NeMo
AutoModel's implementation (``tools/goldens/dspark_golden.py`` recorded ``fixtures/dspark_golden.pt``), and as a drafter."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams, envs
from deepinfer.models.deepseek_v41.dspark import ONE_PROJECTION_MAX_ROWS, DraftHeads, DraftInputs
from deepinfer.loading.model_source import EMBEDDED_MODEL_DIR
from deepinfer.plugins.manager import PluginError, registered
from deepinfer.testing.oracle_drafts import WatchingPlugin
from deepinfer.testing.probes import prefill_output

GOLDEN = Path(__file__).parent / "fixtures" / "dspark_golden.pt"
mtp = pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    # these tests check the drafter under the load-based floor, whose lengths do not depend on timing; the measured
    # policy is tests/test_draft_policy.py's
    monkeypatch.setenv("DEEPINFER_SPECULATION_POLICY", "floor")
    envs.reload()


def _embedded(plugin=None, **engine_args):
    with registered(plugin or importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        return LLM("deepinfer-tiny-v4.1", dtype="float32", **engine_args)


@pytest.fixture
def embedded(switched_on):
    return _embedded()


# Exactly equal outputs need arithmetic that does not depend on how many rows a step has: fp32 with dequantized
# weights. With FP8 activation rounding (quantization="auto") a last-bit difference between a one-row decode step
# and a multi-row verification step can cross a rounding boundary (a 6% step) and change later tokens.
EXACT = dict(quantization="none")


def test_draft_logits_and_confidence_match_nemo():
    """NeMo multiplies dequantized weights without rounding activations to FP8: quantization="none" does too. The
    golden ran on a CPU; a GPU sums in another order, and a last-bit difference that crosses an FP8 rounding
    boundary of the context keys (a 6% step in one element) moves the logits further, hence its looser bound."""
    golden = torch.load(GOLDEN, weights_only=True)
    ids = golden["token_ids"].tolist()
    llm = _embedded(quantization="none")
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # one prefill step
    model = llm.engine.model
    golden = {name: t.to(model.embed.weight.device) for name, t in golden.items()}
    drafter = llm.engine.speculator.drafter
    features = prefill_output(llm, ids).features  # what the engine's prefill step handed the drafter
    # 1e-3: the target's indexer keeps 4 compressed entries, a near-tie among which flips with the CPU's vector
    # width (AVX512 vs AVX2: 2e-4 here), as in test_parity_v41
    bound = 1e-3
    assert (features - golden["features"]).abs().max() <= 1e-4 * golden["features"].abs().max()
    window = model.config.window
    contexts, positions = [], []
    for anchor in golden["anchors"].tolist():  # the window before each anchor, in ring order (row p % window)
        seen = torch.arange(max(0, anchor - window), anchor, device=features.device)
        rows = features.new_zeros(window, model.config.hidden_size)
        rows[seen % window] = drafter.draft.project_context(features[seen])
        contexts.append(rows)
        positions.append(torch.full((window,), -1, device=seen.device).index_put_((seen % window,), seen))
    anchors = golden["anchors"]
    inputs = DraftInputs(golden["token_ids"][anchors], anchors, torch.stack(contexts), torch.stack(positions))
    heads = drafter.draft(inputs, model.embed)
    projected = drafter.draft.block_logits(heads, model.project_vocab)
    for position in range(drafter.draft.block_size):
        logits, confidence = drafter.draft.markov(golden["previous"][:, position], heads, position,
                                                  projected(position))
        expected = golden["draft_logits"][:, position]
        assert (logits - expected).abs().max() <= bound * expected.abs().max(), position
        assert torch.allclose(confidence, torch.sigmoid(golden["confidence_logits"][:, position]), atol=bound / 10)


def test_dspark_drafts_are_accepted_and_output_is_unchanged(switched_on, monkeypatch):
    """The embedded model's trained draft: greedy output identical with and without it (fp32), and drafts
    accepted well above chance (the training run measured a mean acceptance length of 1.83)."""
    prompts = ["def fibonacci(n):", "import os\n", '"""Return the']
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    drafted_llm = _embedded(**EXACT)
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN")
    envs.reload()
    plain = LLM("deepinfer-tiny-v4.1", dtype="float32", **EXACT).generate(prompts, params, use_tqdm=False)
    drafted = drafted_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    stats = drafted_llm.engine.speculator.stats
    assert stats.num_drafts > 0 and 1 + stats.num_accepted_tokens / stats.num_drafts > 1.4
    assert all(o.metrics.num_drafts > 0 for o in drafted)


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 16}], ids=["one-step", "chunked"])
def test_the_drafter_keeps_the_window_before_each_anchor(switched_on, engine_args):
    """After a prefill, a request's context holds the projected features of the last ``window`` positions, each in
    row ``position % window``; the anchor (the token just sampled) is not among them. Chunked: the chunks before
    the last, whose steps have no request to draft for, count too."""
    ids = torch.load(GOLDEN, weights_only=True)["token_ids"].tolist()
    seen = {}

    def spy(propose, requests, computed, features):
        drafts = propose(requests, computed, features)
        seen.update({len(r.token_ids): [t.cpu() for t in propose.__self__.pool.view(r)] for r in requests})
        return drafts

    embedded = _embedded(WatchingPlugin(importlib.import_module("deepinfer_mtp.plugin"), propose=spy), **engine_args)
    embedded.generate([ids], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    window = embedded.engine.model.config.window
    rows, positions = seen[len(ids) + 1]  # after the prefill: the anchor is the first sampled token, at len(ids)
    expected = torch.arange(len(ids) - window, len(ids))
    assert torch.equal(positions[expected % window], expected)
    assert rows.abs().sum(-1).gt(0).all()


def test_stages_load_from_the_checkpoint_in_its_formats(embedded):
    """The V4.1 model skips ``mtp.*``; the drafter reads them, quantized projections and experts as stored."""
    draft = embedded.engine.speculator.drafter.draft
    assert len(draft.layers) == 3 and draft.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert draft.layers[0].ffn.experts.w1.weight.dtype == torch.int8  # MXFP4, two values per byte
    assert not any(name.startswith("mtp") for name, _ in embedded.engine.model.named_parameters())


def test_dspark_is_off_unless_switched_on(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN")
    envs.reload()
    assert _embedded().engine.speculator is None


def test_fixed_length_verifies_every_draft_and_varlen_fewer(monkeypatch):
    """DEEPINFER_ENABLE_MTP_VARLEN=0 verifies every draft up to the maximum draft length (DEEPINFER_USE_NEXTN_DECODE,
    here 3); =1 cuts each draft where its confidence-estimated survival drops below the floor, so it verifies
    fewer draft tokens per draft on the same prompts. Output is identical either way."""
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    prompts = ["def fibonacci(n):", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for varlen in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", varlen)
        envs.reload()
        llm = _embedded(**EXACT)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[varlen] = ([o.outputs[0].token_ids for o in outputs], llm.engine.speculator.stats)
    fixed, varlen = runs["0"][1], runs["1"][1]
    assert runs["0"][0] == runs["1"][0]
    # a step verifies 3 drafts unless max_tokens leaves less room (the last steps of each request)
    assert fixed.num_draft_tokens >= 3 * fixed.num_drafts - 2 * len(prompts) * 3
    assert fixed.num_draft_tokens / fixed.num_drafts > varlen.num_draft_tokens / varlen.num_drafts


def test_models_without_dspark_stages_are_refused(tmp_path):
    """DEEPINFER_ENABLE_MTP_VARLEN=1 asks for drafts: a V4.1 checkpoint without stages and dummy weights each get
    an error naming why, not a run without speculation (V4 checkpoints: tests/test_mtp.py)."""
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        with pytest.raises(PluginError, match="load_format='dummy'"):
            LLM("deepinfer-tiny-v4.1", dtype="float32", load_format="dummy")
        config = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
        config["text_config"]["num_nextn_predict_layers"] = 0
        config["text_config"]["compress_ratios"] = config["text_config"]["compress_ratios"][:-3]
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(PluginError, match="no DSpark draft stages"):
            LLM(str(tmp_path), dtype="float32", load_format="dummy", tokenizer=str(EMBEDDED_MODEL_DIR))


def test_bench_speculative_reports_both_runs_and_acceptance(tmp_path, monkeypatch):
    from deepinfer.cli import main

    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")  # the command sets it per run; restored after
    out = tmp_path / "speculative.json"
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        main(["bench", "speculative", "--model", "deepinfer-tiny-v4.1", "--batch-sizes", "2", "--output-len", "12",
              "--quantization", "none", "--output-json", str(out)])
    result = json.loads(out.read_text())["batch_2"]
    drafted_modes = ("fixed_length", "confidence_scheduled", "measured_policy", "fixed_length_synchronous")
    assert result["same_tokens"] and set(result["speedup"]) == set(drafted_modes)
    for mode in drafted_modes:
        drafted = result[mode]
        # the step split: verification forward, draft passes, sampling and acceptance, host
        assert set(drafted["step_split_ms"]) == {"verification_forward", "draft_passes", "sampling_acceptance", "host"}
        if mode == "measured_policy":  # the policy's decisions of the timed run, with their reasons
            assert sum(drafted["policy_choices"].values()) > 0
            continue
        assert result["speedup"][mode] > 0 and drafted["drafts"] > 0
        assert drafted["mean_acceptance_length"] == 1 + drafted["accepted_tokens"] / drafted["drafts"]
        assert len(drafted["acceptance_rate_by_position"]) >= 1
        assert drafted["per_step_ms"]["draft"] > 0  # the drafter's time per step, reported apart
    assert result["without_drafts"]["per_step_ms"]["draft"] == 0
    assert result["fixed_length"]["draft_tokens"] > result["confidence_scheduled"]["draft_tokens"]
    assert "policy_choices" not in result["confidence_scheduled"]
    # on a CPU no step replays a graph, so none overlaps (test_overlapped_speculation.py runs them padded)
    assert result["fixed_length"]["overlapped_steps"] == result["fixed_length_synchronous"]["overlapped_steps"] == 0
    assert result["fixed_length"]["draft_tokens"] == result["fixed_length_synchronous"]["draft_tokens"]


@pytest.mark.parametrize("varlen", ["1", "0"])
def test_drafting_from_padded_graph_steps_matches_eager_steps(monkeypatch, varlen):
    """Padded verification steps (as CUDA graphs replay them; eagerly on a CPU, ``capture=False``) overlap the
    host: the drafter stores the step's kept rows and drafts on the device (``propose_on_device``). Drafts and
    acceptance are those of eager synchronous steps, which draft from the host, under confidence scheduling and
    fixed length."""
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", varlen)
    envs.reload()
    prompts = ["def fibonacci(n):", "import os\n", '"""Return the']
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eager = _embedded(**EXACT)
    expected = eager.generate(prompts, params, use_tqdm=False)
    padded = _embedded(**EXACT, cuda_graphs="padded-eager")
    engine = padded.engine
    outputs = padded.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    ours, theirs = engine.speculator.stats, eager.engine.speculator.stats
    assert (ours.num_drafts, ours.num_draft_tokens, ours.num_accepted_tokens) == (
        theirs.num_drafts, theirs.num_draft_tokens, theirs.num_accepted_tokens)
    assert engine.overlap.launches["following"] > 10 and eager.engine.overlap.launches["following"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_draft_pass_replays_from_cuda_graphs_as_it_runs_eagerly():
    """Where decode steps replay CUDA graphs, the draft pass does too: the same drafts as an eager pass over the
    same padded inputs, and the same output as a run without graphs."""
    prompts = ["def fibonacci(n):", "import os\n", '"""Return the']
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed
    nvidia = pytest.importorskip("deepinfer_nvidia.plugin")
    with registered(nvidia, "nvidia"):
        llm = _embedded(**EXACT)
        eager = _embedded(enforce_eager=True, **EXACT).generate(prompts, params, use_tqdm=False)
    drafter = llm.engine.speculator.drafter
    assert llm.engine.graphs is not None and drafter.graphs is not None
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in eager]
    assert drafter.graphs.graphs, "no draft pass was captured"
    batch = 3
    size = next(s for s in drafter.graphs.sizes if s >= batch)
    g = torch.Generator().manual_seed(0)
    inputs = torch.stack([torch.randint(0, llm.engine.model_config.vocab_size, (batch,), generator=g),
                          torch.randint(8, 40, (batch,), generator=g), torch.tensor([0, 1, 2])])
    padded = torch.zeros(3, size, dtype=torch.int64)
    padded[2] = drafter.pool.empty
    padded[:, :batch] = inputs
    with torch.inference_mode():  # as the engine runs it: the pool and the graph's inputs are inference tensors
        replayed = [t.clone() for t in drafter.graphs(drafter._draft, inputs)]
        eager_tokens, eager_confidences = drafter._draft(padded.cuda())
    assert torch.equal(replayed[0], eager_tokens[:batch])
    assert torch.equal(replayed[1], eager_confidences[:batch])


@pytest.mark.parametrize("batch", [3, ONE_PROJECTION_MAX_ROWS // 5 + 1])
def test_a_draft_pass_projects_its_block_once_while_it_is_small(embedded, batch):
    """Every block position's vocabulary projection in one call (the head's weights read once a pass) up to
    ONE_PROJECTION_MAX_ROWS rows, one call a position beyond: the same logits either way."""
    draft = embedded.engine.speculator.drafter.draft
    block, width = draft.block_size, draft.layers[-1].norm.weight.shape[0]
    heads = DraftHeads(torch.randn(batch, block, width, generator=torch.Generator().manual_seed(batch)))
    head = torch.randn(97, width, generator=torch.Generator().manual_seed(1))
    calls = []

    def project_vocab(rows):
        calls.append(rows.shape[0])
        return rows @ head.T

    projected = draft.block_logits(heads, project_vocab)
    logits = torch.stack([projected(p) for p in range(block)], 1)
    assert calls == ([batch * block] if batch * block <= ONE_PROJECTION_MAX_ROWS else [batch] * block)
    torch.testing.assert_close(logits, heads.normalized @ head.T)


def test_a_drafter_with_draft_graphs_is_freed_without_a_garbage_collection(switched_on, monkeypatch):
    """The draft graphs take the drafter's pass with each call instead of keeping it: kept, the drafter and its
    graphs formed a reference cycle, and on a GPU a released engine's memory waited for some later collection
    (the next V4.1 engine of a bench process ran out of memory beside it)."""
    import gc
    import weakref

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # no graph is captured here
    llm = _embedded()
    drafter = llm.engine.speculator.drafter
    drafter.use_cuda_graphs([1, 2])
    gone = weakref.ref(drafter)
    gc.collect()
    gc.disable()
    try:
        del drafter, llm
        assert gone() is None
    finally:
        gc.enable()
