"""``deepinfer bench throughput|latency``: DeepInfer against HF transformers ``generate`` in one run.

Prompts are random token ids; every request generates exactly ``--output-len`` greedy tokens (EOS ignored).
``throughput`` submits ``--num-prompts`` at once and reports ``vllm bench throughput``'s JSON keys. ``latency``
times a batch of ``--batch-size`` prompts end to end, ``--num-iters`` times, with ``vllm bench latency``'s keys;
it also times batches with one output token (the prefill) and reports prefill and decode tokens/s from the two.
Every batch has fresh prompts, so no prefix-cache hit shortens a prefill. With ``--load-format dummy`` both engines get random weights of the config's shapes (not the same values).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from deepinfer.logger import init_logger

logger = init_logger(__name__)
R = TypeVar("R")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(num)]


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _release() -> None:
    """Frees the previous engine's device memory before the peer loads (both may not fit at once)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # the next engine loads beside whatever is left: a reference kept to the last one shows here, not as an
        # out-of-memory error in the next load
        left = torch.cuda.memory_allocated()
        if left > 2**30:
            logger.warning("%.2f GiB of device memory still allocated after releasing the previous engine",
                           left / 2**30)


def releases_engine(run: Callable[..., R]) -> Callable[..., R]:
    """``run`` (which builds an engine and returns plain results), then ``_release``: once ``run`` has returned,
    not inside it, where its locals (step metrics, a speculator's stats) still reach the engine and a collection
    frees nothing. What they reach may sit in a reference cycle that only a collection frees (a drafter and its
    draft graphs were one), and then released from inside, a run kept its engine's memory until some later
    collection: on the H100 (2026-12-06) the next V4.1 engine of a bench process ran out of memory loading beside
    it."""

    @functools.wraps(run)
    def run_then_release(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        finally:
            _release()

    return run_then_release


def _device(args) -> str:
    if args.device != "auto":
        return args.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_llm(args, **overrides):
    """``LLM`` with every engine option ``_add_common`` parses, then ``overrides`` (batch size, parallelism...): the
    one place a bench builds its engine, so none drops an option the user gave."""
    from deepinfer import LLM

    options = dict(dtype=args.dtype, device=args.device, quantization=args.quantization, load_format=args.load_format,
                   enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                   max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens)
    return LLM(args.model, **(options | overrides))


# -- the two engines, behind one "generate exactly n tokens for these prompts" call ---------------------------
def _deepinfer(args, batch: int):
    from deepinfer import SamplingParams

    llm = build_llm(args, max_num_seqs=max(batch, 1))

    def generate(prompts, output_len: int) -> int:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    generate.step_metrics = llm.engine.step_metrics
    return generate


def _hf(args, batch: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype, device = _DTYPES.get(args.dtype, torch.float32), _device(args)
    if args.load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    model.eval()

    @torch.inference_mode()
    def generate(prompts, output_len: int) -> int:
        ids = torch.tensor(prompts, device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False)
        _synchronize()
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    return generate


ENGINES = {"deepinfer": _deepinfer, "hf_transformers": _hf}


def _engines(args):
    return [name for name in ENGINES if name == "deepinfer" or args.compare_hf]


def timed_generate(llm, prompts, params) -> tuple[float, int]:
    """Seconds ``llm.generate`` takes (the device's queue drained on both sides) and the tokens it generated."""
    _synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _synchronize()
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def _timed(generate, prompts, output_len: int) -> tuple[float, int]:
    _synchronize()
    start = time.perf_counter()
    tokens = generate(prompts, output_len)
    _synchronize()
    return time.perf_counter() - start, tokens


# -- throughput ------------------------------------------------------------------------------------------------
@releases_engine
def _throughput(args, prompts, engine: str) -> dict:
    generate = ENGINES[engine](args, args.num_prompts)
    generate(prompts[:1], 2)  # warm-up
    elapsed, output_tokens = _timed(generate, prompts, args.output_len)
    total = args.num_prompts * args.input_len + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": args.num_prompts,
        "total_num_tokens": total,
        "requests_per_second": args.num_prompts / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def _run_throughput(args, vocab: int) -> dict:
    prompts = _prompts(args.num_prompts, args.input_len, vocab, args.seed)
    results = {}
    for engine in _engines(args):
        results[engine] = _throughput(args, prompts, engine)
    if args.compare_hf:
        results["ratio_output_tokens_per_second"] = (results["deepinfer"]["output_tokens_per_second"]
                                                     / results["hf_transformers"]["output_tokens_per_second"])
    return results


# -- latency ---------------------------------------------------------------------------------------------------
@releases_engine
def _latency(args, vocab: int, engine: str) -> dict:
    generate = ENGINES[engine](args, args.batch_size)

    def batch(iteration: int) -> list[list[int]]:  # fresh prompts every time: no prefix-cache hits
        return _prompts(args.batch_size, args.input_len, vocab, args.seed + iteration)

    for i in range(args.num_iters_warmup):
        generate(batch(-1 - i), args.output_len)
    metrics = getattr(generate, "step_metrics", None)
    if metrics is not None:
        metrics.reset()
    latencies = [_timed(generate, batch(i), args.output_len)[0] for i in range(args.num_iters)]
    breakdown = {"steps_per_batch": metrics.steps / args.num_iters, **metrics.per_step_ms()} if metrics else None
    prefill = [_timed(generate, batch(args.num_iters + i), 1)[0] for i in range(args.num_iters)]
    average, prefill_average = sum(latencies) / len(latencies), sum(prefill) / len(prefill)
    quantiles = torch.quantile(torch.tensor(latencies, dtype=torch.float64),
                               torch.tensor([0.10, 0.25, 0.50, 0.75, 0.90, 0.99], dtype=torch.float64))
    decode_tokens = args.batch_size * (args.output_len - 1)
    return {
        "avg_latency": average,
        "latencies": latencies,
        "percentiles": {str(p): q for p, q in zip((10, 25, 50, 75, 90, 99), quantiles.tolist())},
        "prefill_latency": prefill_average,
        "prefill_tokens_per_second": args.batch_size * args.input_len / prefill_average,
        "decode_tokens_per_second": decode_tokens / (average - prefill_average) if decode_tokens else None,
        **({"step_ms": breakdown} if breakdown else {}),
    }


def _run_latency(args, vocab: int) -> dict:
    results = {}
    for engine in _engines(args):
        results[engine] = _latency(args, vocab, engine)
    if args.compare_hf:
        results["ratio_avg_latency"] = results["hf_transformers"]["avg_latency"] / results["deepinfer"]["avg_latency"]
    return results


# -- command line ----------------------------------------------------------------------------------------------
def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (with --load-format dummy: config only)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"],
                        help="keep FP8/MXFP4 weights (auto) or dequantize them when loading (none)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights in the formats config.json declares, no weight files read")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: attention rows in DeepSeek-V4's 584-byte FP8 layout")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", help="write the results here")


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.set_defaults(run=_run_throughput)


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.set_defaults(run=_run_latency)


def main(args: argparse.Namespace) -> dict:
    from deepinfer.loading.model_source import resolve_model_dir
    from deepinfer.loading.model_registry import model_config

    results = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        **args.run(args, model_config(resolve_model_dir(args.model)).vocab_size),
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    return results
