"""``deepinfer bench throughput``: DeepInfer against HF transformers ``generate`` in one run.

Random token prompts of ``--input-len`` tokens, ``--output-len`` greedy tokens each with EOS
ignored, all ``--num-prompts`` submitted at once (so the decode batch is ``--num-prompts``).
JSON keys follow ``vllm bench throughput``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(num)]


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _result(elapsed: float, args, output_tokens: int) -> dict:
    total = args.num_prompts * args.input_len + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": args.num_prompts,
        "total_num_tokens": total,
        "requests_per_second": args.num_prompts / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def run_deepinfer(args, prompts) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.num_prompts, 1),
              quantization=args.quantization)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return _result(elapsed, args, sum(len(o.outputs[0].token_ids) for o in outputs))


@torch.inference_mode()
def run_hf(args, prompts) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype, torch.float32)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    model.generate(ids[:1], max_new_tokens=2, do_sample=False)  # warm-up
    _synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
    _synchronize()
    elapsed = time.perf_counter() - start
    return _result(elapsed, args, (out.shape[1] - ids.shape[1]) * ids.shape[0])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"],
                        help="keep FP8/MXFP4 weights (auto) or dequantize them when loading (none)")
    parser.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", help="write the results here")


def main(args: argparse.Namespace) -> dict:
    from deepinfer.models.registry import model_config

    vocab = model_config(args.model).vocab_size
    prompts = _prompts(args.num_prompts, args.input_len, vocab, args.seed)
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "deepinfer": run_deepinfer(args, prompts),
    }
    if args.compare_hf:
        results["hf_transformers"] = run_hf(args, prompts)
        results["ratio_output_tokens_per_second"] = (
            results["deepinfer"]["output_tokens_per_second"] / results["hf_transformers"]["output_tokens_per_second"]
        )
    text = json.dumps(results, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    return results
