"""``deepinfer serve``: the engine flags of ``deepinfer generate`` plus the server's own."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.cli.commands import add_engine_arguments, engine_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' to /v1/*")
    server.add_argument("--max-queued", type=int, default=256,
                        help="unfinished requests the server holds (running or waiting); past it a request gets 503")
    server.add_argument("--served-model-name", help="the model name clients ask for (default: --model, or the "
                                                    "checkpoint's directory name)")
    parser.set_defaults(run=run_serve)


class ServerUnavailable(RuntimeError):
    """The server's packages are not installed."""


def _require_server_packages() -> None:
    """The server's ASGI stack is an extra (``deepinfer[serve]``, which build.sh installs): offline users need none."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ServerUnavailable(f"deepinfer serve needs {' and '.join(missing)}: pip install 'deepinfer[serve]'")


def build(args):
    """The engine loop (not started yet: until then the engine may be prepared from this thread) and the app for
    ``args``; ``run_serve`` and the tests serve it."""
    from deepinfer import LLM
    from deepinfer.loading.model_source import resolve_model_dir

    _require_server_packages()
    from deepinfer.serve.app import create_app
    from deepinfer.serve.engine_loop import EngineLoop

    if args.max_queued < 1:
        raise ValueError(f"--max-queued must be >= 1, got {args.max_queued}")
    llm = LLM(args.model, **engine_arguments(args))
    if llm.ranks is not None:
        raise NotImplementedError("deepinfer serve runs one process; data/expert/context parallelism is not "
                                  "supported by the server yet")
    loop = EngineLoop(llm, args.max_queued)
    name = args.served_model_name or args.model or Path(resolve_model_dir(None)).name
    return loop, create_app(loop, name, args.api_key)


def run_serve(args) -> None:
    import uvicorn

    loop, app = build(args)
    loop.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        loop.stop()
