"""The server built from parsed command-line flags: ``deepinfer serve`` runs it, ``deepinfer bench serve`` starts
one in-process, the tests serve it on a loopback port."""

from __future__ import annotations

from pathlib import Path

from deepinfer.engine_flags import engine_arguments


class ServerUnavailable(RuntimeError):
    """The server's packages are not installed."""


def require_server_packages() -> None:
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

    require_server_packages()
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


