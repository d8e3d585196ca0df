"""The engine's command-line flags, shared by ``deepinfer generate``, ``deepinfer serve`` and ``deepinfer bench
serve`` (a module of its own so that the CLI, the server and the benches can all take them without importing
each other)."""

from __future__ import annotations

import argparse


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--model and the engine flags, shared by ``generate`` and ``serve``; ``engine_arguments`` reads them back."""
    parser.add_argument("--model", help="checkpoint directory or hub id (default: DeepSeek-V4.1-Flash, or "
                                        "DEEPINFER_HF_MODEL_DIR); deepinfer-tiny-v4.1 is the embedded model")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, npu, npu:N")
    engine.add_argument("--quantization", default="auto", choices=["auto", "none"])
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])


def add_warm_up_argument(parser) -> None:
    """The server's warm-up flag (``deepinfer serve``, and the server ``deepinfer bench serve`` starts)."""
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                        help="before serving, run the prompt lengths and decode batch sizes the server will meet once, "
                             "so that no request waits for a kernel build or a CUDA-graph capture (default: on a GPU; "
                             "a CPU builds and captures nothing)")


def engine_arguments(args) -> dict:
    """The engine keyword arguments of ``LLM`` that ``add_engine_arguments`` declared."""
    return dict(dtype=args.dtype, device=args.device, quantization=args.quantization,
                max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype)
