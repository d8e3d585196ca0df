"""``deepinfer bench serve``: requests sent to ``deepinfer serve`` on loopback at a rate and a concurrency bound;
time to first token, time per output token, inter-token latency, throughput.

The flags and the result's JSON keys are ``vllm bench serve``'s (random dataset only): ``--num-prompts`` prompts of
``--random-input-len`` random token ids each ask ``--random-output-len`` tokens of ``/v1/completions``, streamed.
Arrivals are a Poisson process at ``--request-rate`` per second (``inf``: all at once; ``--burstiness`` other than 1
draws gamma intervals), at most ``--max-concurrency`` in flight. Without ``--base-url`` the server runs in a
child process on a free loopback port, from the engine flags of ``deepinfer serve``. Several ``--request-rate`` or
``--max-concurrency`` values make a sweep: one run per pair, on the same server.

- TTFT: from sending a request to its first text; TPOT: (latency - TTFT) / (output tokens - 1); ITL: the time between
  consecutive chunks of text (a chunk may hold more than one token: see docs/serve.md).
- Output tokens are the server's count (``usage.completion_tokens``), not the chunks'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import re
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from deepinfer.engine_flags import add_engine_arguments, add_warm_up_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    bench = parser.add_argument_group("benchmark (vllm bench serve's names)")
    bench.add_argument("--base-url", help="a running server (e.g. http://127.0.0.1:8000); default: start one here")
    bench.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"])
    bench.add_argument("--served-model-name", help="the model name sent in requests (default: --model)")
    bench.add_argument("--num-prompts", type=int, default=32)
    bench.add_argument("--random-input-len", type=int, default=64)
    bench.add_argument("--random-output-len", type=int, default=32)
    bench.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                       help="requests per second (inf: all at once); several values: a sweep")
    bench.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival intervals (1: Poisson)")
    bench.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                       help="requests in flight at most (default: unbounded); several values: a sweep")
    bench.add_argument("--ignore-eos", action="store_true", help="every request makes --random-output-len tokens")
    bench.add_argument("--num-warmups", type=int, default=1,
                       help="requests sent before each run, under its concurrency bound, and not measured "
                            "(as many as the bound lets the first timed steps find their batch sizes compiled)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles reported")
    bench.add_argument("--save-result", action="store_true", help="write each run's JSON")
    bench.add_argument("--result-dir", default=".")
    bench.add_argument("--result-filename", help="the JSON's file name (one run only)")
    bench.add_argument("--max-queued", type=int, default=4096, help="the in-process server's --max-queued")
    add_warm_up_argument(bench)
    bench.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="the in-process server's engine in a process of its own, as deepinfer serve runs it")


def main(args: argparse.Namespace) -> list[dict]:
    import importlib.util

    from deepinfer.serve.launch import ServerUnavailable, require_server_packages

    require_server_packages()
    if importlib.util.find_spec("httpx") is None:
        raise ServerUnavailable("deepinfer bench serve needs httpx: pip install 'deepinfer[serve]'")
    _check(args)
    runs = [(rate, bound) for rate in args.request_rate for bound in args.max_concurrency]
    if args.result_filename and len(runs) > 1:
        raise ValueError("--result-filename names one file: give one --request-rate and one --max-concurrency, "
                         "or leave it out (each run's default name carries its rate and concurrency)")
    with _Server(args) as server:
        results = []
        for run, (rate, bound) in enumerate(runs):
            # prompts of its own for each run and each warm-up: none may be in the prefix cache already (its
            # prefill would then be a fraction of the prompt, and not what the run says it measures)
            prompts, warmups = (_random_prompts(server.tokenizer, server.vocab, args.random_input_len, count,
                                                args.seed + 2 * run + i)
                                for i, count in enumerate((args.num_prompts, args.num_warmups)))
            if args.num_warmups:
                asyncio.run(_send(server, args, warmups, math.inf, bound))
            before = server.engine_totals()
            started = time.perf_counter()
            outcomes = asyncio.run(_send(server, args, prompts, rate, bound))
            result = _metrics(outcomes, time.perf_counter() - started, args, rate, bound, server.model)
            result |= _during(before, server.engine_totals())
            _print(result, args)
            if args.save_result:
                _save(result, args)
            results.append(result)
    return results


def _check(args) -> None:
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for rate in args.request_rate:
        if not rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {rate}")
    for bound in args.max_concurrency:
        if bound is not None and bound < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {bound}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    args.percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    if not all(0 < p < 100 for p in args.percentiles):
        raise ValueError(f"--metric-percentiles must lie in (0, 100), got {args.metric_percentiles}")


class _Server:
    """The server to send to: ``--base-url``, or ``deepinfer serve`` started in a child process on a free loopback
    port. A child, not a thread: in one process the client's stream parsing, the HTTP server and the engine loop
    would share one interpreter lock, and at high concurrency the client would slow the server it measures (vllm
    bench serve is a process of its own too)."""

    def __init__(self, args):
        self.args = args
        self.process = self.pipe = None

    def __enter__(self):
        from deepinfer.loading.model_source import resolve_model_dir
        from deepinfer.loading.tokenizer import load_tokenizer

        args = self.args
        self.model = args.served_model_name or args.model or resolve_model_dir(None).name
        self.tokenizer = load_tokenizer(resolve_model_dir(args.model))  # the prompts' vocabulary
        self.vocab = len(self.tokenizer)
        if args.base_url:
            self.url = args.base_url.rstrip("/")
            return self
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or device state inherited
        self.pipe, child_end = context.Pipe()
        # not a daemon: its engine may run in a process of its own (a daemon may have none); it ends when this
        # process says stop or goes away
        self.process = context.Process(target=_serve_in_child, args=(args, child_end), name="deepinfer-bench-server")
        self.process.start()
        child_end.close()
        try:
            kind, value = self.pipe.recv()  # the engine's loading and warm-up come first: no time bound here
        except EOFError:
            kind, value = "error", f"it exited with code {self.process.exitcode} before it was ready"
        if kind == "error":
            self.__exit__()
            raise RuntimeError(f"the benchmark's server did not start: {value}")
        port, model_vocab = value
        # the tokenizer may name fewer or more ids than the model's embedding has rows: both bound a prompt's ids
        self.vocab = min(self.vocab, model_vocab)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def engine_totals(self) -> dict[str, float]:
        """The server's ``deepinfer_*_total`` counters now (its /metrics), by name less prefix and suffix; empty
        where the server has none (another server behind ``--base-url``)."""
        import httpx

        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        return {name: float(value) for name, value in re.findall(r"^deepinfer_(\w+)_total (\S+)$", text, re.M)}

    def __exit__(self, *exc):
        if self.process is None:
            return
        try:
            self.pipe.send("stop")
        except OSError:  # it has gone already
            pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.pipe.close()
        self.process = None


def _serve_in_child(args, pipe) -> None:
    """The child's life: build the server, report ("ready", (port, vocabulary)) or ("error", why), serve until the
    parent says stop or goes away."""
    import socket

    import uvicorn

    from deepinfer.serve import launch

    try:
        args.api_key = None
        loop, app = launch.build(args)
        loop.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    except BaseException as exc:  # the child's stderr has the traceback too
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        raise

    def stop_when_told() -> None:
        while not server.started:  # ready only once it accepts connections
            if server.should_exit:  # it failed to start: the process ends, and the parent reads why from its exit
                return
            time.sleep(0.02)
        pipe.send(("ready", (port, loop.vocab_size)))
        try:
            pipe.recv()
        except EOFError:  # the parent went away
            pass
        server.should_exit = True

    threading.Thread(target=stop_when_told, daemon=True).start()
    try:
        server.run()
    finally:
        loop.stop()


def _random_prompts(tokenizer, vocab: int, length: int, count: int, seed: int) -> list[list[int]]:
    """Random token ids, as vllm's random dataset, drawn from the vocabulary less its special tokens (an EOS or a
    chat marker inside a prompt is not what a user sends)."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([t for t in range(vocab) if t not in special])
    return [rng.choice(allowed, length).tolist() for _ in range(count)]


async def _send(server, args, prompts, rate: float, bound: int | None) -> list[dict]:
    import httpx

    rng = np.random.default_rng(args.seed)
    gate = asyncio.Semaphore(bound) if bound else None
    limits = httpx.Limits(max_connections=bound or len(prompts), max_keepalive_connections=bound or len(prompts))
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=None) as client:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(_one(client, gate, server.model, prompt, args)))
            if rate != math.inf:  # gamma intervals of mean 1/rate; shape 1 is Poisson's exponential
                await asyncio.sleep(rng.gamma(args.burstiness, 1 / (rate * args.burstiness)))
        return await asyncio.gather(*tasks)


async def _one(client, gate, model: str, prompt: list[int], args) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.random_output_len, "temperature": 0,
            "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    outcome = {"ok": False, "ttft": None, "itl": [], "latency": None, "output_tokens": 0, "input_tokens": 0,
               "error": ""}
    if gate is not None:
        await gate.acquire()
    try:
        start = last = time.perf_counter()
        async with client.stream("POST", args.endpoint, json=body) as response:
            if response.status_code != 200:
                outcome["error"] = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome["error"] = chunk["error"]["message"]
                    return outcome
                if chunk.get("usage"):
                    outcome["output_tokens"] = chunk["usage"]["completion_tokens"]
                    outcome["input_tokens"] = chunk["usage"]["prompt_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if outcome["ttft"] is None:
                        outcome["ttft"] = now - start
                    else:
                        outcome["itl"].append(now - last)
                    last = now
        outcome["latency"] = time.perf_counter() - start
        outcome["ok"] = outcome["ttft"] is not None
        if not outcome["ok"]:
            outcome["error"] = "no text came back"
    except Exception as exc:  # a failed request is counted and named, as vllm's "failed"; the run goes on
        outcome["error"] = repr(exc)
    finally:
        if gate is not None:
            gate.release()
    return outcome


def _during(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server's engine did during a timed run: its steps, and the CUDA graphs it captured and Triton
    kernels it built (each a stall its warm-up did not take); None where the server does not count them."""
    def delta(name: str) -> int | None:
        return int(after[name] - before[name]) if name in before and name in after else None

    return {"engine_steps": delta("steps"), "graph_captures": delta("cuda_graph_captures"),
            "kernel_compiles": delta("kernel_compiles"), "cached_prompt_tokens": delta("cached_prompt_tokens")}


def _metrics(outcomes: list[dict], duration: float, args, rate: float, bound: int | None, model: str) -> dict:
    done = [o for o in outcomes if o["ok"]]
    output_tokens = sum(o["output_tokens"] for o in done)
    input_tokens = sum(o["input_tokens"] for o in done)
    ttfts = [o["ttft"] for o in done]
    tpots = [(o["latency"] - o["ttft"]) / (o["output_tokens"] - 1) for o in done if o["output_tokens"] > 1]
    itls = [gap for o in done for gap in o["itl"]]
    latencies = [o["latency"] for o in done]
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "deepinfer", "model_id": model,
              "endpoint": args.endpoint, "num_prompts": args.num_prompts,
              "request_rate": "inf" if rate == math.inf else rate, "burstiness": args.burstiness,
              "max_concurrency": bound, "random_input_len": args.random_input_len,
              "random_output_len": args.random_output_len, "ignore_eos": args.ignore_eos,
              "machine": f"{platform.processor() or platform.machine()}",
              "duration": duration, "completed": len(done), "failed": len(outcomes) - len(done),
              "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
              "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
              "total_token_throughput": (input_tokens + output_tokens) / duration}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", latencies)):
        ms = [1e3 * v for v in values] or [0.0]
        result |= {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
                   f"std_{name}_ms": statistics.pstdev(ms)}
        for p in args.percentiles:
            result[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    result |= {"input_lens": [o["input_tokens"] for o in outcomes], "output_lens": [o["output_tokens"] for o in outcomes],
               "ttfts": [o["ttft"] for o in outcomes], "itls": [o["itl"] for o in outcomes],
               "errors": [o["error"] for o in outcomes]}
    return result


def _print(result: dict, args) -> None:
    rows = [("Request rate", result["request_rate"]), ("Max concurrency", result["max_concurrency"]),
            ("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", f"{result['duration']:.2f}"),
            ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
            ("Engine steps", result.get("engine_steps")), ("CUDA graphs captured", result.get("graph_captures")),
            ("Triton kernels built", result.get("kernel_compiles"))]
    for name in ("ttft", "tpot", "itl"):
        rows += [(f"Mean {name.upper()} (ms)", f"{result[f'mean_{name}_ms']:.2f}"),
                 (f"Median {name.upper()} (ms)", f"{result[f'median_{name}_ms']:.2f}")]
        rows += [(f"P{p:g} {name.upper()} (ms)", f"{result[f'p{p:g}_{name}_ms']:.2f}") for p in args.percentiles]
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    for label, value in rows:
        print(f"{label + ':':<40}{value!s:>10}")
    print("=" * 50)
    if result["failed"]:
        print(f"first error: {next(e for e in result['errors'] if e)}")


def _save(result: dict, args) -> None:
    concurrency = result["max_concurrency"] or "inf"
    name = args.result_filename or (f"deepinfer-{result['request_rate']}qps-concurrency{concurrency}-"
                                    f"{Path(result['model_id']).name}-{result['date']}.json")
    path = Path(args.result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
