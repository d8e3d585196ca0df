"""The Ascend backend (``backends/ascend``) on a CPU: what can be checked without an NPU.

* Packaging and hooks: the entry point, importing without torch_npu, declining on a CPU, without torch_npu and in
  batch-invariant mode, the clear error for ``device="npu"`` without torch_npu, ``tools/validation/ascend_validate.py``'s exit.
* Expert parallelism's token exchange: tests/test_ascend_exchange.py.
* Conversions: the backends' own code run with each torch_npu operator replaced by ``DOCUMENTED``, plain-torch
  renderings of what the operator's op-plugin doc (and its CPU golden) says it computes, which also assert the
  input constraints the doc states. Equal to the reference backends on random inputs, they show that the arguments
  DeepInfer builds mean what the reference computes. They say nothing about the NPU's kernels: that is what
  ``tools/validation/ascend_validate.py`` is for, on an Ascend machine.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends" / "ascend"))  # when not pip-installed

from deepinfer import envs  # noqa: E402
from deepinfer.engine.config import EngineConfig  # noqa: E402
from deepinfer.runtime.fp8_kv import FP8Rows  # noqa: E402
from deepinfer.runtime.ops import swiglu  # noqa: E402
from deepinfer.runtime.quantization import round_fp8  # noqa: E402
from deepinfer.plugins.builtin.torch_attention import TorchAttention  # noqa: E402
from deepinfer.plugins.builtin.torch_mhc import TorchMHC  # noqa: E402
from deepinfer.plugins.builtin.torch_moe import TorchMoE  # noqa: E402
from deepinfer.plugins import manager  # noqa: E402
from deepinfer.plugins.manager import check_pending, load_entry_point_plugins, load_plugins, select_backend  # noqa: E402
from deepinfer.testing.backend_fixtures import random_experts, stand_in_ranks  # noqa: E402
from deepinfer_ascend import layouts, plugin  # noqa: E402
from deepinfer_ascend.attention import AscendAttention  # noqa: E402
from deepinfer_ascend.mhc import AscendMHC  # noqa: E402
from deepinfer_ascend.moe import AscendMoE  # noqa: E402

CPU = torch.device("cpu")
NPU_LIKE = SimpleNamespace(type="npu")  # what torch.device("npu") is once torch_npu is imported; unbuildable here
SERVED_HOOKS = ("deepinfer_attention_backend", "deepinfer_moe_backend", "deepinfer_mhc_backend")
MODULES = ("deepinfer_ascend", "deepinfer_ascend.npu", "deepinfer_ascend.layouts", "deepinfer_ascend.attention",
           "deepinfer_ascend.moe", "deepinfer_ascend.mhc", "deepinfer_ascend.exchange", "deepinfer_ascend.plugin")


# --- packaging and hooks -----------------------------------------------------------------------------------------

def test_distribution_declares_the_entry_point_and_no_torch_npu_dependency():
    project = tomllib.loads((ROOT / "backends" / "ascend" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "deepinfer-ascend"
    assert project["entry-points"]["deepinfer.plugins"] == {"ascend": "deepinfer_ascend.plugin"}
    assert not any("torch_npu" in dep.replace("-", "_") for dep in project["dependencies"])


def test_modules_import_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    saved = {name: sys.modules.pop(name) for name in MODULES}
    try:
        for name in MODULES:
            importlib.import_module(name)
        assert sys.modules["torch_npu"] is None
    finally:
        sys.modules.update(saved)


def test_entry_point_loads_and_the_builtins_serve_a_cpu(install, monkeypatch):
    monkeypatch.setattr(manager, "_loaded", False)
    load_plugins()
    install("deepinfer_ascend_dist", {"ascend": "deepinfer_ascend.plugin"})
    monkeypatch.setenv("DEEPINFER_PLUGINS", "ascend")
    envs.reload()
    assert load_entry_point_plugins() == ["ascend"]
    check_pending()  # every hookimpl names a real hook
    for hook in (*SERVED_HOOKS, "deepinfer_linear_backend", "deepinfer_sampler"):
        _, served_by = select_backend(hook, config=None, device=CPU)
        assert served_by.startswith("deepinfer.plugins.builtin."), (hook, served_by)
    _, served_by = select_backend("deepinfer_token_exchange", config=None, ranks=stand_in_ranks(CPU))
    assert served_by.startswith("deepinfer.plugins.builtin."), served_by


@pytest.mark.parametrize("hook", SERVED_HOOKS)
def test_hook_declines_on_a_cpu(hook):
    assert getattr(plugin, hook)(config=None, device=CPU) is None


@pytest.mark.parametrize("hook", SERVED_HOOKS)
def test_hook_declines_on_an_npu_without_torch_npu(hook, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert getattr(plugin, hook)(config=EngineConfig(), device=NPU_LIKE) is None


@pytest.mark.parametrize("hook", SERVED_HOOKS)
def test_hook_declines_in_batch_invariant_mode(hook, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    envs.reload()
    assert getattr(plugin, hook)(config=EngineConfig(), device=NPU_LIKE) is None


def test_configure_engine_names_torch_npu_when_an_npu_is_asked_for(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert plugin.deepinfer_configure_engine(EngineConfig(device="cpu")) is None
    with pytest.raises(ValueError, match="needs torch_npu"):
        plugin.deepinfer_configure_engine(EngineConfig(device="npu:0"))


def test_validation_script_exits_clearly_without_an_npu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends" / "ascend")])}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "validation" / "ascend_validate.py")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "nothing was validated" in done.stdout + done.stderr


# --- the operators' documented semantics, in plain torch ---------------------------------------------------------

def documented_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, actual_seq_lengths_query,
                                      actual_seq_lengths_kv, query_rope, key_rope, sparse_block_size, layout_query,
                                      layout_kv, sparse_mode, attention_mode, return_softmax_lse, sinks):
    """MLA-absorb: scores over [q | q_rope] . [k | k_rope], softmax with exp(sink) in the denominator, times the
    value rows; a row's ids are read up to its first -1; no mask with sparse_mode 0."""
    tokens, heads, dim = query.shape
    assert (layout_query, layout_kv, attention_mode, sparse_mode, sparse_block_size) == ("TND", "TND", 2, 0, 1)
    assert query.dtype in (torch.bfloat16, torch.float16) and key.dtype == value.dtype == query.dtype
    assert dim == 512 and query_rope.shape == (tokens, heads, 64) and not return_softmax_lse
    assert key.shape[1:] == (1, 512) and key_rope.shape == (key.shape[0], 1, 64) and value.shape == key.shape
    assert sparse_indices.dtype == torch.int32 and sparse_indices.shape[:2] == (tokens, 1)
    assert actual_seq_lengths_query.tolist() == [tokens] and actual_seq_lengths_kv.tolist() == [key.shape[0]]
    assert sinks.dtype == torch.float32 and sinks.shape == (heads,)
    out = torch.empty(tokens, heads, dim)
    for t in range(tokens):
        ids = sparse_indices[t, 0].tolist()
        count = ids.index(-1) if -1 in ids else len(ids)
        assert set(ids[count:]) <= {-1}, "valid ids must come first"
        chosen = torch.tensor(ids[:count], dtype=torch.long)
        q = torch.cat([query[t], query_rope[t]], -1).float()
        k = torch.cat([key[chosen, 0], key_rope[chosen, 0]], -1).float()
        scores = q @ k.T * scale_value
        top = torch.maximum(scores.amax(-1), sinks)
        exps = (scores - top[:, None]).exp()
        probs = exps / (exps.sum(-1) + (sinks - top).exp())[:, None]
        out[t] = probs @ value[chosen, 0].float()
    return out.to(query.dtype), None, None


def documented_moe_init_routing_v2(x, expert_idx, *, active_num, expert_capacity, expert_num, drop_pad_mode,
                                   expert_tokens_num_type, expert_tokens_num_flag, quant_mode, active_expert_range,
                                   row_idx_type):
    """Dropless, unquantized: keyValueSort of the flat slots by expert (stable), expanded_x[i] = x[sorted[i] // K],
    gather-type expanded_row_idx[sorted[i]] = i, per-expert counts."""
    assert (drop_pad_mode, quant_mode, row_idx_type, expert_tokens_num_type) == (0, -1, 0, 1) and expert_tokens_num_flag
    assert expert_idx.dtype == torch.int32 and active_num == expert_idx.numel()
    assert list(active_expert_range) == [0, expert_num]
    flat = expert_idx.flatten().long()
    order = flat.argsort(stable=True)
    row_of_slot = torch.empty_like(order)
    row_of_slot[order] = torch.arange(order.numel())
    counts = torch.bincount(flat, minlength=expert_num)
    return x[order // expert_idx.shape[1]], row_of_slot.int(), counts, torch.empty(0)


def documented_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type):
    """m-axis groups given by their sizes: y_i = x_i @ weight_i, one output tensor in x's dtype."""
    assert (split_item, group_type, group_list_type, len(x), len(weight)) == (3, 0, 1, 1, 1)
    (x,), (weight,) = x, weight
    assert x.dtype == weight.dtype and group_list.dtype == torch.int64 and int(group_list.sum()) == x.shape[0]
    pieces = [part.float() @ w.float() for part, w in zip(x.split(group_list.tolist()), weight)]
    return [torch.cat(pieces).to(x.dtype)]


def documented_clipped_swiglu(x, *, dim, alpha, limit, bias, interleaved):
    a, b = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=dim)
    a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
    return a * torch.sigmoid(alpha * a) * (b + bias)


def documented_mhc_sinkhorn(x, *, eps, num_iters, out_flag):
    assert x.dtype == torch.float32 and x.shape[-1] in (4, 6, 8) and out_flag == 0 and x.shape[0] <= 512
    norm = x.softmax(-1) + eps
    norm = norm / (norm.sum(-2, keepdim=True) + eps)
    for _ in range(num_iters - 1):
        norm = norm / (norm.sum(-1, keepdim=True) + eps)
        norm = norm / (norm.sum(-2, keepdim=True) + eps)
    return norm, None, None


def documented_mhc_post(x, h_res, h_out, h_post):
    """op-plugin's golden: h_post (x) h_out + sum_i h_res[..., i, o] * x[..., i, :], in fp32, in x's dtype."""
    assert x.dtype in (torch.bfloat16, torch.float16) and h_out.dtype == x.dtype
    assert h_res.dtype == h_post.dtype == torch.float32
    mixed = (h_res.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(-3)
    return (h_post.unsqueeze(-1) * h_out.float().unsqueeze(-2) + mixed).to(x.dtype)


# stands where the torch_npu module goes; its functions are the renderings above
DOCUMENTED = SimpleNamespace(npu_sparse_flash_attention=documented_sparse_flash_attention,
                             npu_moe_init_routing_v2=documented_moe_init_routing_v2,
                             npu_grouped_matmul=documented_grouped_matmul,
                             npu_clipped_swiglu=documented_clipped_swiglu,
                             npu_mhc_sinkhorn=documented_mhc_sinkhorn,
                             npu_mhc_post=documented_mhc_post)


# --- sparse attention ----------------------------------------------------------------------------------------------

def _indices(g, tokens, width, rows):
    ids = torch.randint(0, rows, (tokens, width), generator=g)
    return ids.masked_fill(torch.rand(tokens, width, generator=g) < 0.3, -1)


def _attention_inputs(g, tokens, heads, layout, fp8=False):
    q = torch.randn(tokens, heads, 512, generator=g).bfloat16()
    rows = {"single": (30,), "concatenated": (12, 9), "gathered": (300, 200)}[layout]
    sources = []
    for i, count in enumerate(rows):
        pool = torch.randn(count, 512, generator=g).bfloat16()
        if fp8 and i == 1:
            pool, plain = FP8Rows.zeros(count), pool
            pool.write(torch.arange(count), plain)
        sources.append((pool, _indices(g, tokens, 8 if i == 0 else 6, count)))
    sources[0][1][:, 0] = 0  # every query sees at least one key (its own window row)
    return q, sources, torch.randn(heads, generator=g), 512 ** -0.5


@pytest.mark.parametrize("layout,fp8", [("single", False), ("concatenated", False), ("concatenated", True),
                                        ("gathered", False), ("gathered", True)])
def test_sparse_attention_matches_the_reference(layout, fp8):
    q, sources, sinks, scale = _attention_inputs(torch.Generator().manual_seed(1), 8, 4, layout, fp8)
    keys = {"single": 30, "concatenated": sum(layouts.pool_rows(pool) for pool, _ in sources), "gathered": 8 * 14}
    pieces = [(rows, k.shape[0]) for rows, k, _ in layouts.sfa_pieces(q, sources)]
    assert pieces == [(slice(0, 8), keys[layout])]  # the path the test's name says
    ours = AscendAttention(DOCUMENTED).sparse_attention(q, sources, sinks, scale)
    reference = TorchAttention().sparse_attention(q, sources, sinks, scale)
    torch.testing.assert_close(ours.float(), reference.float(), atol=2e-2, rtol=2e-2)


def test_gathered_pieces_cover_every_query_in_chunks():
    q, sources, sinks, scale = _attention_inputs(torch.Generator().manual_seed(2), 7, 2, "gathered")
    pieces = list(layouts.sfa_pieces(q, sources, budget=3 * 14 * 512))
    assert [p[0] for p in pieces] == [slice(0, 3), slice(3, 6), slice(6, 7)]
    ours = torch.cat([documented_sparse_flash_attention(*a, **k)[0] for a, k in
                      (layouts.sfa_arguments(q[rows], keys, ids, sinks, scale) for rows, keys, ids in pieces)])
    reference = TorchAttention().sparse_attention(q, sources, sinks, scale)
    torch.testing.assert_close(ours.float(), reference.float(), atol=2e-2, rtol=2e-2)


def test_valid_ids_move_first_in_order():
    ids = torch.tensor([[3, -1, 5, -1, 7], [-1, -1, 2, 0, -1]])
    assert layouts.valid_first(ids).tolist() == [[3, 5, 7, -1, -1], [2, 0, -1, -1, -1]]


def test_attention_the_operator_cannot_take_goes_to_the_reference():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 64, generator=g)  # the tiny models' heads: fp32, 64 wide
    sources = [(torch.randn(10, 64, generator=g), _indices(g, 3, 5, 10).clamp(min=0))]
    sinks = torch.randn(4, generator=g)
    ours = AscendAttention(None).sparse_attention(q, sources, sinks, 0.125)  # None: no operator may be called
    assert torch.equal(ours, TorchAttention().sparse_attention(q, sources, sinks, 0.125))


# --- routed experts ------------------------------------------------------------------------------------------------

def _routing(g, tokens, experts=8, k=3):
    ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :k]
    return ids, torch.rand(tokens, k, generator=g)


# (expert format, activations, largest relative error ||ours - reference|| / ||reference||): fp32 runs in fp32;
# bf16 activations round gate/up and w2's outputs to bf16 (documented in deepinfer_ascend.moe), which for FP8/MXFP4
# experts also moves some of the SwiGLU's FP8 roundings by one code. Over 50 seeds the largest errors were 2e-7,
# 0.4% (bf16 experts) and 1.6% (quantized experts, bf16 activations).
@pytest.mark.parametrize("fmt,dtype,tol", [(torch.float32, torch.float32, 1e-6), ("fp8", torch.float32, 1e-6),
                                           ("mxfp4", torch.float32, 1e-6), (torch.bfloat16, torch.bfloat16, 1e-2),
                                           ("mxfp4", torch.bfloat16, 3e-2), ("fp8", torch.bfloat16, 3e-2)])
def test_routed_experts_match_the_reference(fmt, dtype, tol):
    g = torch.Generator().manual_seed(4)
    weights = random_experts(g, fmt)
    x = (torch.randn(9, 64, generator=g) * 3).to(dtype)  # large enough that the SwiGLU clamp bites
    ids, w = _routing(g, 9)
    ours = AscendMoE(DOCUMENTED).routed_experts(x, ids, w, weights)
    reference = TorchMoE().routed_experts(x, ids, w, weights).float()
    assert ours.dtype == dtype
    assert (ours.float() - reference).norm() <= tol * reference.norm()


def test_converted_experts_follow_in_place_changes_and_no_tokens_compute_nothing():
    g = torch.Generator().manual_seed(5)
    weights, backend = random_experts(g, torch.float32), AscendMoE(DOCUMENTED)
    x, (ids, w) = torch.randn(4, 64, generator=g), _routing(g, 4)
    backend.routed_experts(x, ids, w, weights)
    with torch.no_grad():
        weights.w2[ids[0, 0]].mul_(-2)  # what expert rebalancing's in-place copies do
    torch.testing.assert_close(backend.routed_experts(x, ids, w, weights),
                               TorchMoE().routed_experts(x, ids, w, weights), atol=1e-5, rtol=1e-5)
    empty = AscendMoE(None).routed_experts(x[:0], ids[:0], w[:0], weights)
    assert empty.shape == (0, 64) and empty.dtype == x.dtype


def test_experts_the_operators_cannot_take_go_to_the_reference():
    g = torch.Generator().manual_seed(11)
    mixed = random_experts(g, "fp8")
    mixed.w3, mixed.w3_scale = torch.randn(8, 32, 64, generator=g), None  # w1 quantized, w3 not
    single = random_experts(g, torch.float32, experts=1)
    x, (ids, w) = torch.randn(4, 64, generator=g), _routing(g, 4, k=2)
    assert torch.equal(AscendMoE(None).routed_experts(x, ids, w, mixed), TorchMoE().routed_experts(x, ids, w, mixed))
    one = torch.zeros(4, 1, dtype=torch.long)
    assert torch.equal(AscendMoE(None).routed_experts(x, one, w[:, :1], single),
                       TorchMoE().routed_experts(x, one, w[:, :1], single))


def test_quantized_experts_are_exact_in_bf16_and_so_are_rounded_activations():
    g = torch.Generator().manual_seed(6)
    weights = random_experts(g, "mxfp4")
    as_bf16 = layouts.grouped_weight(weights.w1, weights.w1_scale, torch.bfloat16)
    assert torch.equal(as_bf16.float(), layouts.grouped_weight(weights.w1, weights.w1_scale, torch.float32))
    x = torch.randn(5, 64, generator=g) * 7
    rounded = layouts.activation(x, weights.w1_scale, 32, torch.bfloat16)
    assert torch.equal(rounded.float(), round_fp8(x, 32))


@pytest.mark.parametrize("limit", [0.5, 10.0, float("inf")])
def test_clipped_swiglu_arguments_give_our_swiglu(limit):
    g = torch.Generator().manual_seed(7)
    gate, up = torch.randn(6, 16, generator=g) * 4, torch.randn(6, 16, generator=g) * 4
    args, kwargs = layouts.clipped_swiglu_arguments(torch.cat([gate, up], -1), limit)
    torch.testing.assert_close(documented_clipped_swiglu(*args, **kwargs), swiglu(gate, up, limit))


# --- hyper-connections ---------------------------------------------------------------------------------------------

def test_mhc_coefficients_match_the_reference_across_row_chunks():
    logits = torch.randn(700, 24, generator=torch.Generator().manual_seed(8))  # > 512 rows: two operator calls
    for ours, reference in zip(AscendMHC(DOCUMENTED).coefficients(logits, 4, 20, 1e-6),
                               TorchMHC().coefficients(logits, 4, 20, 1e-6)):
        torch.testing.assert_close(ours, reference)


def test_mhc_expand_matches_the_reference():
    g = torch.Generator().manual_seed(9)
    streams, output = torch.randn(5, 4, 32, generator=g).bfloat16(), torch.randn(5, 32, generator=g).bfloat16()
    post, comb = torch.rand(5, 4, generator=g), F.softmax(torch.randn(5, 4, 4, generator=g), -1)
    ours = AscendMHC(DOCUMENTED).expand(streams, output, post, comb)
    assert torch.equal(ours, TorchMHC().expand(streams, output, post, comb))


def test_mhc_outside_the_operators_range_goes_to_the_reference():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(3, 15, generator=g)  # n = 3
    for ours, reference in zip(AscendMHC(None).coefficients(logits, 3, 5, 1e-6), TorchMHC().coefficients(logits, 3, 5, 1e-6)):
        assert torch.equal(ours, reference)
    streams, output = torch.randn(2, 4, 8, generator=g), torch.randn(2, 8, generator=g)  # fp32 streams
    post, comb = torch.rand(2, 4, generator=g), torch.rand(2, 4, 4, generator=g)
    assert torch.equal(AscendMHC(None).expand(streams, output, post, comb),
                       TorchMHC().expand(streams, output, post, comb))
