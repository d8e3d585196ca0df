"""The ``deepinfer`` logger tree: one handler, one line format, level from the environment."""

from __future__ import annotations

import functools
import logging

from deepinfer import envs

ROOT_LOGGER_NAME = "deepinfer"
_LINE_FORMAT = "%(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s"
_TIME_FORMAT = "%H:%M:%S"

_handler = logging.StreamHandler()
_handler.setFormatter(logging.Formatter(_LINE_FORMAT, _TIME_FORMAT))

_already_logged: set[tuple[str, int, str]] = set()


@functools.cache
def _configure_root() -> logging.Logger:
    root = logging.getLogger(ROOT_LOGGER_NAME)
    # The handler goes in before the environment is parsed so that warnings about unknown
    # DEEPINFER_* variables already come out in this format; a parse error is not cached,
    # so the next call must not add it twice.
    if _handler not in root.handlers:
        root.addHandler(_handler)
    # A host application that configures the root logger would otherwise print every line twice.
    root.propagate = False
    root.setLevel(envs.get().DEEPINFER_LOGGING_LEVEL)
    return root


def init_logger(name: str) -> logging.Logger:
    """The logger for ``name`` (usually ``__name__``), placed under the ``deepinfer`` root."""
    _configure_root()
    if name != ROOT_LOGGER_NAME and not name.startswith(ROOT_LOGGER_NAME + "."):
        name = f"{ROOT_LOGGER_NAME}.{name}"
    return logging.getLogger(name)


def set_rank(rank: int | None) -> None:
    """Under parallelism every line says which rank wrote it (None: a single process again)."""
    line = _LINE_FORMAT if rank is None else _LINE_FORMAT.replace("]", f" rank{rank}]", 1)
    _handler.setFormatter(logging.Formatter(line, _TIME_FORMAT))


def log_once(logger: logging.Logger, level: int, msg: str) -> None:
    """Log ``msg`` the first time this process sees it; every worker would otherwise repeat it."""
    key = (logger.name, level, msg)
    if key in _already_logged:
        return
    _already_logged.add(key)
    # stacklevel=2 so the line shows the caller, not this helper.
    logger.log(level, msg, stacklevel=2)
