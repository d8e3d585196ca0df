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
    """The engine's loop (not started yet) and the app for ``args``; ``run_serve`` and the tests serve it. With
    ``args.engine_process`` (the default) the loop is ``EngineProcess``: ``start`` spawns the engine's process and
    loads the model there; otherwise ``EngineLoop`` on a thread of this process, its engine loaded here (until
    ``start`` it may be prepared from this thread)."""
    from deepinfer.loading.model_source import resolve_model_dir

    require_server_packages()
    from deepinfer.serve.app import create_app

    if args.max_queued < 1:
        raise ValueError(f"--max-queued must be >= 1, got {args.max_queued}")
    if args.engine_process:
        from deepinfer.serve.engine_process import EngineProcess

        loop = EngineProcess(args.model, engine_arguments(args), args.max_queued, args.warm_up)
    else:
        loop = _engine_loop(args)
    name = args.served_model_name or args.model or Path(resolve_model_dir(None)).name
    return loop, create_app(loop, name, args.api_key)


def _engine_loop(args):
    from deepinfer.serve.engine_loop import EngineLoop
    from deepinfer.serve.engine_process import serving_llm

    return EngineLoop(serving_llm(args.model, engine_arguments(args), args.warm_up), args.max_queued)

