"""``deepinfer bench`` commands on tiny models (they are scripts: these check what they report, not speed)."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main
from deepinfer.plugins.manager import registered
from deepinfer.testing.flash_fixtures import FIXTURES, write_fixture

# flash4L's layer pattern and vocabulary at a size a CPU test can hold
SHRUNK = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_attention_heads=4, head_dim=64,
              qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=32, o_groups=2, index_n_heads=4, index_head_dim=32,
              index_topk=8)


@pytest.mark.parametrize("model", ["tiny_v4", "deepinfer-tiny-v4.1"])
def test_bench_latency_reports_vllm_keys_and_rates(model, tiny_v4_checkpoint, tmp_path):
    out = tmp_path / "latency.json"
    model = str(tiny_v4_checkpoint) if model == "tiny_v4" else model
    main(["bench", "latency", "--model", model, "--input-len", "20", "--output-len", "5",
          "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "2", "--output-json", str(out)])
    result = json.loads(out.read_text())["deepinfer"]
    assert len(result["latencies"]) == 2 and result["avg_latency"] == sum(result["latencies"]) / 2
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert 0 < result["prefill_latency"] < result["avg_latency"]
    assert result["prefill_tokens_per_second"] == 3 * 20 / result["prefill_latency"]
    assert result["decode_tokens_per_second"] > 0


def test_bench_throughput_on_the_embedded_model_reports_vllm_keys(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    main(["bench", "throughput", "--model", "deepinfer-tiny-v4.1", "--num-prompts", "3", "--input-len", "12",
          "--output-len", "5", "--output-json", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result  # printed and written alike
    run = result["deepinfer"]
    assert set(run) == {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
                        "tokens_per_second", "output_tokens_per_second"}
    assert run["num_requests"] == 3 and run["total_num_tokens"] == 3 * (12 + 5)  # EOS ignored: every token made
    assert run["tokens_per_second"] == run["total_num_tokens"] / run["elapsed_time"]
    assert run["requests_per_second"] == 3 / run["elapsed_time"]


def test_bench_fullscale_reports_load_prefill_and_decode_per_gpu(tmp_path):
    """The full-scale bench on the embedded model across two CPU ranks (experts split between them)."""
    out = tmp_path / "fullscale.json"
    main(["bench", "fullscale", "--model", "deepinfer-tiny-v4.1", "--ranks", "2", "--device", "cpu",
          "--batch-sizes", "1", "3", "--prefill-len", "40", "--input-len", "12", "--output-len", "4",
          "--output-json", str(out)])
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["speculative_decoding"] is False and result["load_time_s"] > 0
    prefill = result["prefill"]
    assert prefill["prompts"] == 2 and prefill["tokens_per_second"] == 2 * 40 / prefill["seconds"]
    assert [d["batch_per_gpu"] for d in result["decode"]] == [1, 3]
    for decode in result["decode"]:
        assert decode["tokens_per_second"] == 2 * decode["tokens_per_second_per_gpu"] > 0


@pytest.mark.parametrize("flags, complaint", [(["--output-len", "1"], "output-len"), (["--ranks", "0"], "ranks"),
                                              (["--compare-hf"], "compare-hf")])
def test_bench_fullscale_refuses_what_it_cannot_measure(flags, complaint, capsys):
    with pytest.raises(SystemExit) as exit_:  # a user error: one line, exit 2
        main(["bench", "fullscale", "--model", "deepinfer-tiny-v4.1", "--device", "cpu", *flags])
    assert exit_.value.code == 2 and complaint in capsys.readouterr().err


def test_flash4l_fixture_loads_dummy_bf16_weights(tmp_path):
    model_dir = write_fixture("flash4L", tmp_path / "flash4L", **SHRUNK)
    llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy", device="cpu")
    config = llm.engine.model_config
    assert config.compress_ratios == [0, 0, 4, 128] and config.vocab_size == 129280
    # no quantization_config: every weight is bf16 (or fp32 where the release keeps fp32), none FP8/MXFP4
    dtypes = {t.dtype for t in llm.engine.model.state_dict().values()}
    assert dtypes <= {torch.bfloat16, torch.float32, torch.int64}, dtypes
    outputs = llm.generate([list(range(3, 300))], use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) > 0


def test_flash4lfp8_fixture_loads_dummy_fp8_experts(tmp_path):
    """V4-Flash-Base's formats: the routed experts FP8 like the projections (``expert_dtype`` "fp8"), not MXFP4."""
    model_dir = write_fixture("flash4Lfp8", tmp_path / "flash4Lfp8", **SHRUNK)
    llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy", device="cpu")
    layer = llm.engine.model.layers[3]
    assert layer.ffn.experts.w1.weight.dtype == layer.attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert layer.ffn.experts.w1.scale.shape[-2:] == (1, 1)  # one 128 x 128 tile of a shrunk [32, 64] expert
    outputs = llm.generate([list(range(3, 300))], use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) > 0


def test_expert_dtype_must_be_a_known_format(tmp_path):
    model_dir = write_fixture("flash4Lfp8", tmp_path / "bad", **SHRUNK, expert_dtype="fp6")
    with pytest.raises(ValueError, match="expert_dtype must be 'fp4' or 'fp8'; got 'fp6'"):
        LLM(str(model_dir), dtype="bfloat16", load_format="dummy", device="cpu")


@pytest.mark.parametrize("name", ["v41flash8L", "v41flash", "v41flash6Ldspark"])
def test_v41_fixtures_load_dummy_released_formats(tmp_path, name):
    """The V4.1-Flash-shaped fixtures, their widths shrunk and their layer schedules kept (``v41flash``: the
    release's 40 layers, the full-scale run; ``v41flash6Ldspark``: the H100's speculative fixture, its draft stages
    reading its last three layers)."""
    shrunk = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_attention_heads=4, head_dim=64,
                  qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=32, o_groups=2, index_n_heads=4,
                  index_head_dim=32, index_topk=8, engram_n_heads=2, engram_head_dim=32, engram_vocab_size=97,
                  engram_num_embeddings=[2000] * len(FIXTURES[name]["engram_layer_ids"]))
    if name == "v41flash":
        shrunk |= {"candidate_topk_blocks": 4, "candidate_block_size": 2}
    model_dir = write_fixture(name, tmp_path / name, **shrunk)
    if "dspark" in name:  # with its draft stages: speculative decoding on
        mtp = pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")
        with registered(mtp, "mtp"):
            llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy", device="cpu", enable_mtp_varlen=True,
                      synthetic_acceptance_length=2.8)
        assert llm.engine.speculator is not None
    else:
        llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy", device="cpu")
    model = llm.engine.model
    layers = FIXTURES[name]["num_hidden_layers"]  # the draft stages' ratios follow the target's
    assert llm.engine.model_config.compress_ratios == FIXTURES[name]["compress_ratios"][:layers]
    assert len(model.layers) == layers
    assert model.layers[3].ffn.experts.w1.weight.dtype == torch.int8  # MXFP4, as released
    assert model.layers[3].attn.wq_b.weight.dtype == torch.float8_e4m3fn
    outputs = llm.generate([list(range(3, 300))], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) > 0
    if "dspark" in name:
        assert llm.engine.counters()["num_drafts"] > 0


def test_step_metrics_account_for_every_step(tiny_v4_checkpoint):
    llm = LLM(str(tiny_v4_checkpoint), dtype="float32", device="cpu")
    metrics = llm.engine.step_metrics
    metrics.reset()
    llm.generate([[5, 6, 7], list(range(3, 40))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    per_step = metrics.per_step_ms()
    assert metrics.steps >= 6  # a prefill step, then one decode step per further token
    assert all(per_step[phase] > 0 for phase in ("schedule", "prepare", "forward", "sample", "outputs"))
    assert per_step["device"] == 0  # no CUDA events on a CPU


def test_dspark_fixtures_cut_to_fewer_layers_keep_their_stages_on_the_last_three():
    from deepinfer.testing.flash_fixtures import dspark_layers

    cut = dspark_layers(4)
    assert cut["num_hidden_layers"] == 4 and cut["dspark_target_layer_ids"] == [1, 2, 3]
    assert cut["compress_ratios"] == FIXTURES["v41flash8L"]["compress_ratios"][:4] + [0, 0, 0]
    with pytest.raises(ValueError, match="3 to 8 target layers, got 2"):
        dspark_layers(2)
