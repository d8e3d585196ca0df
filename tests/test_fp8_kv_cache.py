"""``kv_cache_dtype="fp8"``: a V4 model's attention rows (window and compressed entries) stored in DeepSeek-V4's FP8
layout give the same outputs as bf16/fp32 rows up to FP8 rounding, in less memory; other models refuse it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.runtime import fp8_kv
from deepinfer.runtime.fp8_kv import FP8Rows
from deepinfer.plugins.builtin.torch_attention import TorchAttention
from deepinfer.plugins.manager import registered
from deepinfer.testing.tiny_v4 import build_tiny_v4

V41_FIXTURE = Path(__file__).parent / "fixtures" / "v41_tiny"
PROMPTS = [list(range(3, 60)), [7, 9, 11] * 7]


@pytest.fixture(scope="module")
def wide_v4(tmp_path_factory):
    """The tiny V4 with the released 512-wide rows (448 NoPE + 64 RoPE), the layout's only width."""
    return build_tiny_v4(tmp_path_factory.mktemp("wide_v4"), head_dim=512, qk_rope_head_dim=64, num_attention_heads=2,
                        index_head_dim=128)


def _run(checkpoint, **engine_args):
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                 for o in outputs]


def test_fp8_rows_read_back_what_rounding_the_rows_gives(wide_v4, monkeypatch):
    """Against the plain cache with every 512-wide row written through quantize/dequantize: the same values are
    read, so the outputs are identical, bit for bit."""
    fp8_llm, fp8 = _run(wide_v4, kv_cache_dtype="fp8")
    assert isinstance(fp8_llm.engine.cache.pool("swa", "kv", 0), FP8Rows)

    def rounded_store(pool, slots, rows):
        if rows.shape[-1] == fp8_kv.WIDTH:
            rows = fp8_kv.dequantize(*fp8_kv.quantize(rows))
        pool.index_copy_(0, slots, rows.to(pool.dtype))

    monkeypatch.setattr(TorchAttention, "store_rows", lambda self, pool, slots, rows: rounded_store(pool, slots, rows))
    rounded_llm, rounded = _run(wide_v4)
    assert fp8 == rounded
    # a third of the plain cache's bytes for these pools: the FP8 one is smaller overall
    assert fp8_llm.engine.cache.nbytes() < rounded_llm.engine.cache.nbytes()


def test_fp8_rows_stay_close_to_full_precision(wide_v4):
    _, fp8 = _run(wide_v4, kv_cache_dtype="fp8")
    _, plain = _run(wide_v4)
    for (tokens, steps), (_, plain_steps) in zip(fp8, plain):
        first = tokens[0]  # the prefill's token: its logprob moves by FP8 rounding only
        assert first in plain_steps[0] and abs(steps[0][first] - plain_steps[0][first]) < 0.2


def test_kv_cache_dtype_is_validated(wide_v4):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(wide_v4), device="cpu", kv_cache_dtype="int8")


def test_models_without_the_layout_refuse_it():
    with pytest.raises(ValueError, match="V4.1's cache layout has no FP8 form"):
        LLM(str(V41_FIXTURE), dtype="float32", device="cpu", kv_cache_dtype="fp8")


def test_rows_of_another_width_are_refused(tiny_v4_checkpoint):
    with pytest.raises(ValueError, match="512-wide rows"):
        LLM(str(tiny_v4_checkpoint), dtype="float32", device="cpu", kv_cache_dtype="fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fp8_rows_replay_in_cuda_graphs_as_they_run_eagerly(wide_v4):
    """On the GPU the NVIDIA plugin's attention decodes the FP8 rows itself, inside the captured decode steps."""
    nvidia = pytest.importorskip("deepinfer_nvidia.plugin")

    def tokens(**engine_args):
        llm = LLM(str(wide_v4), dtype="bfloat16", device="cuda", kv_cache_dtype="fp8", **engine_args)
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm

    with registered(nvidia, "nvidia"):
        eager, _ = tokens(enforce_eager=True)
        replayed, llm = tokens()
    assert llm.engine.graphs is not None and llm.engine.graphs.graphs
    assert replayed == eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashMLA needs a GPU")
def test_flashmla_serves_the_fp8_cache_like_the_triton_kernel(tmp_path, monkeypatch):
    """With 64 heads FlashMLA's sparse decode serves every attention call over the FP8 cache; its first-token
    logprobs agree with the Triton kernel's on the same cache."""
    deepseek_kernels = pytest.importorskip("deepinfer_nvidia.deepseek_kernels")
    nvidia = pytest.importorskip("deepinfer_nvidia.plugin")
    sparse_decode, route = deepseek_kernels.flash_mla()
    if sparse_decode is None:
        pytest.skip(f"FlashMLA not provisioned: {route}")
    checkpoint = build_tiny_v4(tmp_path / "heads64", head_dim=512, qk_rope_head_dim=64, num_attention_heads=64,
                               index_head_dim=128)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return sparse_decode(*args, **kwargs)

    def first_logprobs():
        with registered(nvidia, "nvidia"):
            llm = LLM(str(checkpoint), dtype="bfloat16", device="cuda", kv_cache_dtype="fp8")
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
            return [o.outputs[0].logprobs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    monkeypatch.setattr(deepseek_kernels, "flash_mla", lambda: (counted, route))
    flashmla = first_logprobs()
    assert calls
    monkeypatch.setattr(deepseek_kernels, "flash_mla", lambda: (None, "off for the comparison"))
    triton_only = first_logprobs()
    for ours, theirs in zip(flashmla, triton_only):
        shared = set(ours) & set(theirs)
        assert shared and all(abs(ours[t].logprob - theirs[t].logprob) < 0.05 for t in shared)
