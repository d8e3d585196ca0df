"""Where ``deepinfer serve`` spends its host time: the CPU seconds of the server's event-loop thread (uvicorn runs it
on the main thread: HTTP, the server-sent events) and of its other threads (the engine loop, torch's workers) while
``deepinfer bench serve`` streams through it, per generated token. Linux only (reads /proc).

    python tools/profiling/serve_threads.py --model /tmp/tinyv41 --dtype float32 --max-concurrency 64

The server and its engine loop share one interpreter lock, so at high concurrency the event loop's time per token,
times the tokens a step makes, is host time a step must find besides the engine's own. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request


def thread_seconds(pid: int) -> tuple[float, float]:
    """(main thread, all other threads) CPU seconds of process ``pid`` so far."""
    tick, main, other = os.sysconf("SC_CLK_TCK"), 0.0, 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        main, other = (main + seconds, other) if int(tid) == pid else (main, other + seconds)
    return main, other


def bench(url: str, model: str, prompts: int, output_len: int, concurrency: int) -> str:
    command = [sys.executable, "-m", "deepinfer.cli", "bench", "serve", "--base-url", url, "--model", model,
               "--num-prompts", str(prompts), "--random-input-len", "32", "--random-output-len", str(output_len),
               "--ignore-eos", "--max-concurrency", str(concurrency)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=64)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "serve", "--model", args.model, "--dtype",
                               args.dtype, "--port", str(args.port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        else:
            raise SystemExit("the server did not come up in 120 s")
        bench(url, args.model, 16, 16, args.max_concurrency)  # warm-up: first requests, lazy imports
        before = thread_seconds(server.pid)
        report = bench(url, args.model, args.num_prompts, args.output_len, args.max_concurrency)
        after = thread_seconds(server.pid)
    finally:
        server.terminate()
        server.wait()
    tokens = args.num_prompts * args.output_len
    throughput = re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", report)
    print(json.dumps({"max_concurrency": args.max_concurrency, "tokens": tokens,
                      "output_tokens_per_second": float(throughput.group(1)) if throughput else None,
                      "event_loop_cpu_s": round(after[0] - before[0], 3),
                      "other_threads_cpu_s": round(after[1] - before[1], 3),
                      "event_loop_us_per_token": round(1e6 * (after[0] - before[0]) / tokens, 1)}))


if __name__ == "__main__":
    main()
