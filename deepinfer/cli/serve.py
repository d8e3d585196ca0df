"""``deepinfer serve``: the engine flags of ``deepinfer generate`` plus the server's own."""

from __future__ import annotations

import argparse

from deepinfer.engine_flags import add_engine_arguments, add_warm_up_argument
from deepinfer.serve.launch import ServerUnavailable, build  # noqa: F401 (the CLI's and the tests' names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' to /v1/*")
    server.add_argument("--max-queued", type=int, default=256,
                        help="unfinished requests the server holds (running or waiting); past it a request gets 503")
    server.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine in a process of its own, so that the HTTP event loop and the engine's "
                             "steps do not share one interpreter lock (--no-engine-process: on a thread of the "
                             "server's process)")
    add_warm_up_argument(server)
    server.add_argument("--served-model-name", help="the model name clients ask for (default: --model, or the "
                                                    "checkpoint's directory name)")
    parser.set_defaults(run=run_serve)


def run_serve(args) -> None:
    import uvicorn

    loop, app = build(args)
    loop.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        loop.stop()
