"""DeepInfer's DeepSeek-V4 against HF transformers' DeepseekV4ForCausalLM on a tiny random checkpoint.

The checkpoint (see deepinfer.testing.tiny_v4) has a sliding layer, two CSA layers (ratio 4,
index top-4) and an HCA layer (ratio 16), window 8 and a hash-routed first layer, so ~300-token
prompts evict the window, close many compression windows and make the indexer choose; 64 decode
steps cross both ratio boundaries many times.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.runtime.ops import mhc_logits
from deepinfer.models.deepseek_v4.layers import unweighted_rms_norm
from deepinfer.testing.probes import prefill_logits

STEPS = 64
PROMPT_LENGTHS = (300, 17, 123, 64, 5, 250, 31, 190)


@pytest.fixture(scope="module")
def checkpoint(tiny_v4_checkpoint):
    return tiny_v4_checkpoint


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import DeepseekV4ForCausalLM


    return DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _cache(output):
    # transformers renamed past_key_values to cache after 5.17 (the GPU machine has 5.17)
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, tokens = _cache(out), []
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), use_cache=True, **{_cache_kwarg(model): cache})
        cache = _cache(out)
    return tokens


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts):
    return [_hf_greedy(hf_model, p, STEPS) for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_prefill_logits_match_hf(checkpoint, hf_model, prompts):
    llm = LLM(str(checkpoint), dtype="float32")
    for prompt in (prompts[0], prompts[2]):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        ours = prefill_logits(llm, prompt)
        relative = (ours - reference).abs().max() / reference.abs().max()
        assert relative < 1e-4, f"prompt of {len(prompt)} tokens: max relative error {relative:.2e}"


def test_greedy_alone_matches_hf(checkpoint, prompts, hf_greedy):
    llm = LLM(str(checkpoint), dtype="float32")
    for prompt, expected in zip(prompts[:3], hf_greedy[:3]):
        assert _generate(llm, [prompt]) == [expected]


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="batched"),
        pytest.param({"max_num_batched_tokens": 64}, id="chunked-prefill"),
        pytest.param({"enable_chunked_prefill": False, "max_num_batched_tokens": 1024}, id="no-chunking"),
        pytest.param({"num_cache_tokens": 512, "block_size": 16, "enable_prefix_caching": False}, id="preempted"),
    ],
)
def test_greedy_batch_of_8_matches_hf(checkpoint, prompts, hf_greedy, engine_args):
    llm = LLM(str(checkpoint), dtype="float32", **engine_args)
    assert _generate(llm, prompts) == hf_greedy
    if "num_cache_tokens" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_gives_same_tokens(checkpoint, prompts, hf_greedy):
    llm = LLM(str(checkpoint), dtype="float32", block_size=16)
    assert _generate(llm, prompts[:2]) == hf_greedy[:2]
    outputs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy[:2]
    assert outputs[0].metrics.num_cached_tokens >= 256


def test_mhc_logits_project_before_normalising_within_fp32():
    """V4 (and HF) normalise the flat streams and then project; ``runtime.ops.mhc_logits`` projects and then scales by
    the RMS, as V4.1's released kernel does: the same logits, up to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    n, width = 4, 256
    streams = (torch.randn(7, n, width, generator=g) * 3).bfloat16()
    fn = torch.randn((2 + n) * n, n * width, generator=g) * 0.01
    base, scale = torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
    mix = unweighted_rms_norm(streams.flatten(1).float(), 1e-6) @ fn.T
    scales = torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))
    torch.testing.assert_close(mhc_logits(streams, fn, base, scale, 1e-6), torch.addcmul(base, mix, scales),
                               rtol=1e-5, atol=1e-6)
