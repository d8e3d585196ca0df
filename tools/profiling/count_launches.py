"""Kernel launches in one padded decode step (what a CUDA graph holds), counted on a CPU: no GPU needed.

    TRITON_INTERPRET=1 PYTHONPATH=.:backends/nvidia python tools/profiling/count_launches.py [DTYPE, default bfloat16] [--ops]
        [--model=DIR] [--prompt-len=N]

Builds a tiny V4 with flash4L's layer pattern (sliding, sliding, CSA, HCA; three hash-routed), serves attention, MoE
and mHC with the NVIDIA plugin's Triton kernels (run by Triton's interpreter) and counts, per decode step, the
Triton launches and the outermost torch ops by module (each such op is at least one kernel on a GPU; views and
allocations are left out). Graph launch time on the host and the device's gaps between kernels both grow with it.
``--ops`` lists the torch ops by name; ``--model=DIR`` counts another checkpoint's step instead (e.g.
``tests/fixtures/v41_tiny``, V4.1 with FP8 and MXFP4 weights, whose projections the plugin's Triton GEMM serves;
its interpreted prefill is slow: ``--prompt-len=40`` shortens it, default 197, past a ratio-128 window).
"""

from __future__ import annotations

import collections
import sys
import tempfile
import types
from pathlib import Path

from torch.profiler import profile, record_function
from triton.runtime import interpreter

from deepinfer import LLM, SamplingParams
from deepinfer.plugins import hookimpl
from deepinfer.plugins.builtin.torch_moe import TorchMoE
from deepinfer.plugins.manager import registered
from deepinfer.testing.tiny_v4 import build_tiny_v4
from deepinfer_nvidia.fp8_linear import TritonLinear
from deepinfer_nvidia.mhc import TritonMHC
from deepinfer_nvidia.moe import TritonMoE
from deepinfer_nvidia.attention import TritonAttention

NO_KERNEL = {"view", "as_strided", "empty", "empty_strided", "unsqueeze", "squeeze", "slice", "select", "expand",
             "t", "transpose", "permute", "reshape", "_reshape_alias", "detach", "alias", "lift_fresh", "_unsafe_view",
             "resolve_conj", "resolve_neg", "result_type", "unflatten", "split", "chunk", "narrow", "unbind",
             "view_as_real", "view_as_complex", "empty_like", "flatten", "contiguous", "dim", "size", "stride",
             "split_with_sizes", "movedim", "expand_as", "view_as", "broadcast_tensors"}


def _triton_on_cpu() -> types.ModuleType:
    plugin = types.ModuleType("triton_on_cpu")
    plugin.deepinfer_attention_backend = hookimpl(tryfirst=True)(lambda config, device: TritonAttention())
    plugin.deepinfer_moe_backend = hookimpl(tryfirst=True)(lambda config, device: TritonMoE(reference=TorchMoE()))
    plugin.deepinfer_mhc_backend = hookimpl(tryfirst=True)(lambda config, device: TritonMHC())
    plugin.deepinfer_linear_backend = hookimpl(tryfirst=True)(lambda config, device: TritonLinear())
    return plugin


def _outermost(event) -> tuple[bool, str]:
    """Whether ``event`` is a torch op outside any other op or Triton launch, and its module."""
    parent, module = event.cpu_parent, "model"
    while parent is not None:
        if parent.name.startswith(("aten::", "triton::")):
            return False, ""
        if parent.name.startswith("module::") and module == "model":
            module = parent.name.removeprefix("module::")
        parent = parent.cpu_parent
    return True, module


def main() -> None:
    launches: collections.Counter = collections.Counter()
    interpret = interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        with record_function("triton::" + self.fn.__name__):
            return interpret(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = launch
    model = next((a.removeprefix("--model=") for a in sys.argv[1:] if a.startswith("--model=")), None)
    checkpoint = model or build_tiny_v4(Path(tempfile.mkdtemp()) / "flash4L_pattern", num_hash_layers=3, head_dim=64,
                                        qk_rope_head_dim=16, layer_types=["sliding_attention", "sliding_attention",
                                                                          "compressed_sparse_attention",
                                                                          "heavily_compressed_attention"],
                                        compress_rates={"compressed_sparse_attention": 4,
                                                        "heavily_compressed_attention": 128})
    length = int(next((a.removeprefix("--prompt-len=") for a in sys.argv[1:] if a.startswith("--prompt-len=")), 197))
    prompt = [list(range(3, 3 + length))]
    with registered(_triton_on_cpu(), "triton_on_cpu"):
        dtype = next((a for a in sys.argv[1:] if not a.startswith("--")), "bfloat16")
        # decode steps padded as for a CUDA graph, run eagerly
        llm = LLM(str(checkpoint), dtype=dtype, device="cpu", cuda_graphs="padded-eager")
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        ranges = {}

        def enter(module, args):
            ranges[id(module)] = record_function(f"module::{type(module).__name__}")
            ranges[id(module)].__enter__()

        def leave(module, args, out):
            ranges.pop(id(module)).__exit__(None, None, None)

        for module in llm.engine.model.modules():
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)
        graphs, ops, named = llm.engine.graphs, collections.Counter(), collections.Counter()
        forward = graphs._forward

        def counted(inputs):
            launches.clear()
            with profile() as prof:
                out = forward(inputs)
            for event in prof.events():
                name = event.name.removeprefix("aten::")
                copies = name != "to" or any(child.name == "aten::_to_copy" for child in event.cpu_children)
                if event.name.startswith("aten::") and name not in NO_KERNEL and copies:
                    outermost, module = _outermost(event)
                    if outermost:
                        ops[module] += 1
                        named[(module, name)] += 1
            return out

        graphs._forward = counted
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    print(f"one padded decode step: {sum(launches.values())} Triton launches, {sum(ops.values())} torch ops")
    print("  Triton:", dict(launches.most_common()))
    print("  torch ops by module:", dict(ops.most_common()))
    if "--ops" in sys.argv:
        for (module, name), count in sorted(named.items()):
            print(f"    {module:24s} {name:32s} {count}")


if __name__ == "__main__":
    main()
