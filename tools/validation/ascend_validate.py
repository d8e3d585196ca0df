#!/usr/bin/env python3
"""Validate DeepInfer's Ascend backend on an Ascend NPU (it has not been run on one by its authors).

    python tools/validation/ascend_validate.py [--device npu:0] [--max-tokens 24] [--skip-e2e] [--skip-ep]

1. Each hook the Ascend plugin serves, on random inputs at DeepSeek-V4 shapes (512-wide heads, 64/128 heads, MXFP4
   and FP8 experts, 4 hyper-connection streams), on the NPU against the torch reference on the CPU.
2. Expert parallelism's token exchange (npu_moe_distribute_dispatch_v2/combine_v2) on NPUs 0 and 1: two processes
   exchange bf16 tokens of hidden size 4096, run the torch reference MoE on their own experts and must give the
   single-process reference's output. Skipped, saying so, with fewer than 2 NPUs.
3. Which plugin the engine picks for every hook on the NPU.
4. Greedy generation with the embedded model (deepinfer-tiny-v4.1) and a tiny random V4, on the NPU and on the CPU:
   the tokens must agree. (Their 64-wide heads are outside npu_sparse_flash_attention's D=512: attention runs the
   reference there; step 1 covers the operator.)

Prints a pass/fail table. Exit status: 0 all passed, 1 something failed, 2 no usable NPU (nothing was validated).
Run from a checkout (``backends/ascend`` is put on the path when deepinfer-ascend is not installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Check:
    name: str
    error: float  # relative error ||npu - reference|| / ||reference||, or mismatches for generation
    tolerance: float
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance  # NaN fails


def require_npu(device: str):
    """torch_npu, or exit 2 saying why nothing can be validated here."""
    try:
        import torch_npu
    except ImportError as exc:
        no_npu(f"torch_npu is not importable ({exc}); this script needs an Ascend NPU with CANN and torch_npu "
               "(DEEPINFER_ACCELERATOR=ascend ./build.sh)")
    if not torch_npu.npu.is_available() or torch_npu.npu.device_count() == 0:
        no_npu(f"torch_npu sees no NPU for {device} (is CANN's set_env.sh sourced?)")
    return torch_npu


def no_npu(why: str):
    print(f"ascend_validate: {why}: nothing was validated", file=sys.stderr)
    sys.exit(2)


def relative_error(npu_out: torch.Tensor, reference: torch.Tensor) -> float:
    ours, ref = npu_out.detach().float().cpu(), reference.detach().float().cpu()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def attention_checks(ops, device) -> list[Check]:
    from deepinfer.runtime.fp8_kv import FP8Rows
    from deepinfer.plugins.builtin.torch_attention import TorchAttention
    from deepinfer_ascend.attention import AscendAttention

    checks = []
    # (name, tokens, heads, pool rows per source, keys per query per source, an FP8 second pool)
    for name, tokens, heads, rows, widths, fp8 in [
            ("decode, window only", 4, 64, (4096,), (128,), False),
            ("decode, window + 512 entries", 4, 64, (4096, 1024), (128, 512), False),
            ("prefill, 128 heads", 33, 128, (256, 64), (128, 16), False),
            ("decode, FP8 entries", 4, 64, (4096, 1024), (128, 512), True)]:
        g = torch.Generator().manual_seed(tokens + heads)
        q = torch.randn(tokens, heads, 512, generator=g).bfloat16()
        cpu_sources, npu_sources = [], []
        for i, (count, width) in enumerate(zip(rows, widths)):
            ids = torch.randint(0, count, (tokens, width), generator=g)
            ids = ids.masked_fill(torch.rand(tokens, width, generator=g) < 0.25, -1)
            ids[:, 0] = i  # a valid key in every list
            pool = torch.randn(count, 512, generator=g).bfloat16()
            if fp8 and i == 1:
                cpu_pool, npu_pool = FP8Rows.zeros(count), FP8Rows.zeros(count, device)
                cpu_pool.write(torch.arange(count), pool)
                npu_pool.data.copy_(cpu_pool.data.to(device))
            else:
                cpu_pool, npu_pool = pool, pool.to(device)
            cpu_sources.append((cpu_pool, ids))
            npu_sources.append((npu_pool, ids.to(device)))
        sinks = torch.randn(heads, generator=g)
        scale = 512 ** -0.5
        reference = TorchAttention().sparse_attention(q, cpu_sources, sinks, scale)
        out = AscendAttention(ops).sparse_attention(q.to(device), npu_sources, sinks.to(device), scale)
        checks.append(Check(f"attention: {name}", relative_error(out, reference), 1e-2,
                            "npu_sparse_flash_attention (sinks: Ascend 950 only)"))
    return checks


def moe_checks(ops, device) -> list[Check]:
    from deepinfer.runtime.quantization import quantize_fp4, quantize_fp8
    from deepinfer.plugins.builtin.torch_moe import TorchMoE
    from deepinfer.plugins.interfaces import ExpertWeights
    from deepinfer_ascend.moe import AscendMoE

    checks = []
    experts, k, hidden, inter = 64, 6, 1024, 512
    for fmt in ("bf16", "mxfp4", "fp8"):
        g = torch.Generator().manual_seed(len(fmt))
        stacks = [torch.randn(experts, r, c, generator=g) * c ** -0.5 for r, c in
                  ((inter, hidden), (inter, hidden), (hidden, inter))]
        if fmt == "bf16":
            weights = ExpertWeights(*(w.bfloat16() for w in stacks), 10.0)
        else:
            quantize = quantize_fp4 if fmt == "mxfp4" else (lambda w: quantize_fp8(w, 128, 128))
            (w1, s1), (w3, s3), (w2, s2) = ([torch.stack(t) for t in zip(*map(quantize, w))] for w in stacks)
            weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 128)
        on_npu = ExpertWeights(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in
                                 (weights.w1, weights.w3, weights.w2, weights.swiglu_limit, weights.w1_scale,
                                  weights.w3_scale, weights.w2_scale, weights.activation_block)))
        for tokens in (1, 40):
            x = (torch.randn(tokens, hidden, generator=g) * 3).bfloat16()
            ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :k]
            w = torch.rand(tokens, k, generator=g)
            reference = TorchMoE().routed_experts(x, ids, w, weights)
            out = AscendMoE(ops).routed_experts(x.to(device), ids.to(device), w.to(device), on_npu)
            # the CPU proof of the conversions saw up to 1.6% with quantized experts and bf16 activations
            checks.append(Check(f"moe: {fmt} experts, {tokens} tokens", relative_error(out, reference), 3e-2,
                                "npu_moe_init_routing_v2, npu_grouped_matmul, npu_clipped_swiglu"))
    return checks


def mhc_checks(ops, device) -> list[Check]:
    from deepinfer.plugins.builtin.torch_mhc import TorchMHC
    from deepinfer_ascend.mhc import AscendMHC

    checks, n = [], 4
    for tokens in (1, 700):
        logits = torch.randn(tokens, (2 + n) * n, generator=torch.Generator().manual_seed(tokens))
        ours = AscendMHC(ops).coefficients(logits.to(device), n, 20, 1e-6)
        reference = TorchMHC().coefficients(logits, n, 20, 1e-6)
        checks.append(Check(f"mhc: coefficients, {tokens} tokens", relative_error(ours[2], reference[2]), 1e-5,
                            "npu_mhc_sinkhorn"))
    g = torch.Generator().manual_seed(1)
    streams, output = torch.randn(33, n, 4096, generator=g).bfloat16(), torch.randn(33, 4096, generator=g).bfloat16()
    post, comb = torch.rand(33, n, generator=g) * 2, torch.randn(33, n, n, generator=g).softmax(-1)
    out = AscendMHC(ops).expand(*(t.to(device) for t in (streams, output, post, comb)))
    checks.append(Check("mhc: expand (comb[i, o] weights stream i into o)",
                        relative_error(out, TorchMHC().expand(streams, output, post, comb)), 1e-2, "npu_mhc_post"))
    return checks


def _ep_rank(rank: int, port: int, results) -> None:
    """One of two expert-parallel ranks: every (label, relative error or error text) goes to ``results``."""
    import torch.distributed as dist
    import torch_npu
    from types import SimpleNamespace

    sys.path[:0] = [str(ROOT), str(ROOT / "backends" / "ascend")]
    from deepinfer.plugins.builtin.torch_moe import TorchMoE
    from deepinfer.plugins.interfaces import ExpertWeights
    from deepinfer_ascend.exchange import AscendExchange

    device = torch.device("npu", rank)
    torch_npu.npu.set_device(device)
    dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ranks = SimpleNamespace(rank=rank, world_size=2, device=device, device_group=dist.group.WORLD,
                            control_group=dist.new_group(backend="gloo"))
    exchange = AscendExchange.for_ranks(torch_npu, ranks, most=16)  # 16 tokens per call: 40 take three calls
    experts, per_rank, k, hidden = 16, 8, 6, 4096
    g = torch.Generator().manual_seed(0)  # the same inputs on both ranks
    stacks = [torch.randn(experts, r, c, generator=g) * c ** -0.5 for r, c in ((512, hidden), (512, hidden),
                                                                              (hidden, 512))]
    every = ExpertWeights(*(w.bfloat16() for w in stacks), 10.0)
    mine = ExpertWeights(*(w[rank * per_rank:(rank + 1) * per_rank].to(device) for w in (every.w1, every.w3,
                                                                                          every.w2)), 10.0)
    for label, tokens in (("one call", (3, 5)), ("three calls, a rank without tokens", (40, 0))):
        inputs = [((torch.randn(n, hidden, generator=g) * 3).bfloat16(),
                   torch.rand(n, experts, generator=g).argsort(1)[:, :k], torch.rand(n, k, generator=g))
                  for n in tokens]
        x, ids, weights = inputs[rank]
        try:
            work = exchange.dispatch(x.to(device), ids.to(device), weights.to(device), per_rank)
            computed = (TorchMoE().routed_experts(work.rows, work.slots[:, None], work.weights[:, None], mine)
                        if work.rows.shape[0] else work.rows)
            out = exchange.combine(computed, work, x.shape[0]).float().cpu()
            reference = TorchMoE().routed_experts(x, ids, weights, every).float()
            error = float((out - reference).norm() / reference.norm().clamp_min(1e-30)) if x.shape[0] else 0.0
            results.put((rank, label, error))
        except Exception as exc:  # reported as a failed check, on both ranks' behalf
            results.put((rank, label, f"{type(exc).__name__}: {exc}"))
    dist.destroy_process_group()


def ep_checks() -> list[Check]:
    import queue
    import socket
    import torch.multiprocessing as mp
    import torch_npu

    visible = torch_npu.npu.device_count()
    if visible < 2:
        print(f"expert-parallel exchange: skipped (needs 2 NPUs, {visible} visible)")
        return []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_ep_rank, args=(rank, port, results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    checks = []
    for _ in range(4):  # two cases on two ranks; read before joining (a process ends once its queue is drained)
        try:
            rank, label, error = results.get(timeout=600)
        except queue.Empty:
            checks.append(Check("ep: every rank reported", float("nan"), 0,
                                f"a rank hung or died (exit codes {[w.exitcode for w in workers]})"))
            break
        failed = isinstance(error, str)
        checks.append(Check(f"ep: {label}, rank {rank}", float("nan") if failed else error, 1e-2,
                            error if failed else "npu_moe_distribute_dispatch_v2/combine_v2, 2 NPUs"))
    for worker in workers:
        worker.join(timeout=60)
        if worker.is_alive():
            worker.kill()
    return checks


def selected_backends(device) -> list[str]:
    from deepinfer.engine.config import EngineConfig
    from deepinfer.plugins import manager

    manager.load_plugins()
    if not manager.pm.has_plugin("ascend"):  # running from a checkout without the distribution installed
        import deepinfer_ascend.plugin

        manager.pm.register(deepinfer_ascend.plugin, name="ascend")
    config = EngineConfig(device=str(device))
    lines = []
    for hook in ("attention_backend", "moe_backend", "linear_backend", "mhc_backend", "sampler"):
        backend, plugin = manager.select_backend(f"deepinfer_{hook}", config=config, device=device)
        lines.append(f"  {hook:18} {getattr(backend, 'name', type(backend).__name__)} (plugin {plugin})")
    return lines


def generation_checks(device, max_tokens: int) -> list[Check]:
    from deepinfer import LLM, SamplingParams
    from deepinfer.loading.model_source import EMBEDDED_MODEL
    from deepinfer.testing.tiny_v4 import build_tiny_v4

    prompts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [("deepinfer-tiny-v4.1", EMBEDDED_MODEL), ("tiny random V4", str(build_tiny_v4(Path(tmp))))]
        for (label, model), dtype in [(m, d) for m in models for d in ("bfloat16", "float32")]:
            runs = {}
            for where in (str(device), "cpu"):
                llm = LLM(model, device=where, dtype=dtype)
                runs[where] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                del llm
            npu_tokens, cpu_tokens = runs[str(device)], runs["cpu"]
            diverged = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                        for x, y in zip(npu_tokens, cpu_tokens)]
            mismatches = sum(d is not None for d in diverged)
            note = "identical" if not mismatches else f"first divergence per prompt: {diverged}"
            checks.append(Check(f"greedy: {label}, {dtype}", mismatches, 0, note))
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="npu:0")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--skip-e2e", action="store_true", help="only the per-hook checks")
    parser.add_argument("--skip-ep", action="store_true", help="no expert-parallel exchange check (it needs 2 NPUs)")
    args = parser.parse_args()
    torch_npu = require_npu(args.device)
    if importlib.util.find_spec("deepinfer_ascend") is None:
        sys.path.insert(0, str(ROOT / "backends" / "ascend"))
    sys.path.insert(0, str(ROOT))
    device = torch.device(args.device)
    torch.npu.set_device(device)
    cann = getattr(getattr(torch_npu.npu, "utils", None), "get_cann_version", lambda: "unknown")()
    print(f"torch {torch.__version__}, torch_npu {torch_npu.__version__}, CANN {cann}, "
          f"{torch_npu.npu.get_device_name(device)}")
    checks = attention_checks(torch_npu, device) + moe_checks(torch_npu, device) + mhc_checks(torch_npu, device)
    if not args.skip_ep:
        checks += ep_checks()
    print("backends the engine picks on", device)
    print("\n".join(selected_backends(device)))
    if not args.skip_e2e:
        checks += generation_checks(device, args.max_tokens)
    width = max(len(c.name) for c in checks)
    print(f"\n{'check':{width}}  result  error      tolerance  note")
    for c in checks:
        print(f"{c.name:{width}}  {'pass' if c.passed else 'FAIL':6}  {c.error:<9.3g}  {c.tolerance:<9.3g}  {c.note}")
    failed = sum(not c.passed for c in checks)
    print(f"\n{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
