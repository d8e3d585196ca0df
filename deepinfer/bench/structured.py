"""``deepinfer bench structured``: decode speed with and without ``so_args``, at one batch size.

``--batch-size`` requests (the built-in prompts, cycled) generate ``--output-len`` tokens each, once
unconstrained and once with a JSON schema (``--schema-file``, or a built-in object schema), in one process after
a warm-up of each. Reported: decode tokens/s, the per-step time split (``step_metrics``), and the overhead.
The built-in schema cannot be completed within the default length, so every request runs every step in both
runs (a schema that ends sooner shrinks the batch and makes the steps incomparable).
"""

from __future__ import annotations

import argparse
import json

from deepinfer.bench.throughput import _add_common, build_llm, timed_generate
from deepinfer.bench.speculative import PROMPTS

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "id": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "id", "ok"], "additionalProperties": False}, "minItems": 40}  # never done in time


def run(args, vocab: int) -> dict:
    from deepinfer import SamplingParams

    if args.compare_hf:
        raise SystemExit("bench structured compares DeepInfer with itself: --compare-hf does not apply")
    schema = json.load(open(args.schema_file)) if args.schema_file else SCHEMA
    llm = build_llm(args, max_num_seqs=args.batch_size)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch_size)]
    modes = {"unconstrained": None, "json_schema": {"schema_type": "json", "schema": schema}}
    results = {}
    for name, so_args in modes.items():
        params = SamplingParams(temperature=0, max_tokens=args.output_len, so_args=so_args,
                                ignore_eos=so_args is None)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the grammar's compilation)
        llm.engine.step_metrics.reset()
        elapsed, tokens = timed_generate(llm, prompts, params)
        metrics = llm.engine.step_metrics
        results[name] = {"tokens": tokens, "tokens_per_second": tokens / elapsed, "steps": metrics.steps,
                         "ms_per_step": 1e3 * elapsed / max(metrics.steps, 1),
                         "per_step_ms": {k: round(v, 3) for k, v in metrics.per_step_ms().items()}}
    results["step_time_overhead"] = results["json_schema"]["ms_per_step"] / results["unconstrained"]["ms_per_step"] - 1
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--schema-file", help="a JSON schema (default: an array of small objects)")
    parser.set_defaults(run=run)
