"""The ``deepinfer`` command line."""

from __future__ import annotations

import argparse
import sys

import torch

# Set before anything starts torch's thread pool, so every worker thread inherits it
# (subnormal floats make CPU kernels ~100x slower; see LLMEngine).
torch.set_flush_denormal(True)

from deepinfer import envs  # noqa: E402
from deepinfer.bench import fullscale, load, parallel, replay, speculative, structured, throughput, vision  # noqa: E402
from deepinfer.bench import serve as serve_bench  # noqa: E402
from deepinfer.cli import commands as cli_commands  # noqa: E402
from deepinfer.cli import serve as serve_cli  # noqa: E402
from deepinfer.plugins.manager import PluginError  # noqa: E402
from deepinfer.runtime.devices import DeviceUnavailable  # noqa: E402


# What a user can cause and fix (a missing directory, an unreachable hub, a bad argument, a plugin or device that is
# not there): one line, exit 2. Anything else is a bug, and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, NotImplementedError,
               DeviceUnavailable, PluginError, serve_cli.ServerUnavailable)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or envs.get().DEEPINFER_LOGGING_LEVEL == "DEBUG"
    argv = [a for a in argv if a != "--debug"]  # accepted anywhere on the line
    try:
        _run(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print("deepinfer: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except USER_ERRORS as exc:
        if debug:
            raise
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: offline inference for DeepSeek-V4 models")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also DEEPINFER_LOGGING_LEVEL=DEBUG); anywhere on the line")
    commands = parser.add_subparsers(dest="command", required=True)
    cli_commands.add_generate_arguments(commands.add_parser(
        "generate", help="complete prompts and print the outputs",
        description="Complete prompts (arguments or --prompts-file; a literal \\n in a file's line is a newline) "
                    "and print each prompt with its completion, or JSON with --json. Greedy unless --temperature."))
    cli_commands.add_chat_arguments(commands.add_parser(
        "chat", help="talk to the model: a line per message, answers streamed",
        description="A DeepSeek-V4 chat on standard input: each line is a user message, each answer is streamed "
                    "to standard output. /reset forgets the conversation; /exit or the end of input leaves."))
    serve_cli.add_arguments(commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
        description="Serve the model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions (streaming "
                    "as server-sent events), /v1/models, /health, /metrics. One engine loop batches every request "
                    "continuously. See docs/serve.md."))
    cli_commands.add_plugins_arguments(commands.add_parser(
        "plugins", help="registered plugins, their versions and hooks"))
    cli_commands.add_env_arguments(commands.add_parser(
        "env", help="every DEEPINFER_* variable: value, default, meaning"))
    cli_commands.add_draft_vocab_arguments(commands.add_parser(
        "draft-vocab", help="a draft vocabulary (DEEPINFER_DRAFT_VOCAB): a corpus's most frequent tokens",
        description="Count the tokens of text files with the model's tokenizer and write the --size most frequent, "
                    "one id a line: DSpark then drafts from those alone (docs/speculative-decoding.md)."))
    bench_parser = commands.add_parser("bench", help="benchmarks")
    kinds = bench_parser.add_subparsers(dest="kind", required=True)
    throughput.add_throughput_arguments(kinds.add_parser("throughput", help="offline throughput, optionally against HF"))
    throughput.add_latency_arguments(kinds.add_parser("latency", help="latency of one batch, prefill and decode tokens/s"))
    load.add_arguments(kinds.add_parser("load", help="load time and peak host memory"))
    speculative.add_arguments(kinds.add_parser("speculative", help="decode with and without drafts"))
    replay.add_arguments(kinds.add_parser("replay", help="prefill with SWA bounded replay off and compact"))
    structured.add_arguments(kinds.add_parser("structured", help="decode with and without a JSON schema"))
    vision.add_arguments(kinds.add_parser("vision", help="the vision encoder's images/s and time to first token with "
                                          "images"))
    parallel.add_arguments(kinds.add_parser("parallel", help="one rank against data/expert parallelism, EPLB"))
    fullscale.add_arguments(kinds.add_parser("fullscale", help="a model across N GPUs: data-parallel attention, "
                                             "expert-parallel experts (no one-GPU peer)"))
    serve_bench.add_arguments(kinds.add_parser(
        "serve", help="deepinfer serve under load: TTFT, TPOT, ITL, throughput (vllm bench serve's flags)",
        description="Streams random prompts to deepinfer serve on loopback (started here, or --base-url) at "
                    "--request-rate with at most --max-concurrency in flight; several values of either sweep."))
    args = parser.parse_args(argv)
    if args.command == "bench":
        {"load": load.main, "serve": serve_bench.main}.get(args.kind, throughput.main)(args)
    else:
        args.run(args)

