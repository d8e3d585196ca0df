"""The engine in a process of its own, behind ``EngineLoop``'s interface (``deepinfer serve``'s default).

In one process the HTTP server's event loop and the engine's steps share one interpreter lock: at 64 streams the
event loop spends ~54 µs of CPU a token on server-sent events, more than a small model's step leaves free, and
every step then waits for it (the H100's embedded model at c = 64: 3.09 ms a token against 2.02 ms a step
offline). Here the engine's process runs ``EngineLoop`` as the server's process would; the server's process sends
it each submission's order and its aborts over a pipe, and one thread there receives each step's events (one
message a step) and hands them to the submissions' event loops. The queue bound (``--max-queued``) is kept by the
server's process. Counters follow when they change, at most every ``COUNTERS_EVERY_S`` while the engine is busy
and at once when it goes idle.
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
import time

from deepinfer.logger import init_logger
from deepinfer.serve.engine_loop import Delta, EngineLoop, Overloaded, Submission, deliver
from deepinfer.serve.errors import APIError

logger = init_logger(__name__)

COUNTERS_EVERY_S = 0.01
START_TIMEOUT_S = 900  # loading a model (and compiling its kernels) before the process reports ready


class EngineProcess:
    """``start`` spawns the engine's process and waits until its model is loaded; ``submit`` and ``abort`` may be
    called from any thread. The engine's process loads the installed plugins as ``deepinfer serve`` would."""

    def __init__(self, model: str | None, engine_arguments: dict, max_queued: int, warm_up: bool | None = None):
        """``warm_up``: ``warm_up_server``'s (None: its default)."""
        self.max_queued = max_queued
        self._order = (model, engine_arguments, warm_up)
        self._pipe = self._process = self._reader = None
        self._lock = threading.Lock()  # the pipe's writers, and the submissions below
        self._open: dict[int, tuple[Submission, int]] = {}  # key -> (submission, its samples not finished)
        self._keys = itertools.count()
        self.counters: dict = {}
        self.error: str | None = None
        self.max_model_len = self.vocab_size = self.tokenizer = None

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_engine_main, args=(child, *self._order), name="deepinfer-engine",
                                        daemon=True)
        self._process.start()
        child.close()
        try:
            kind, facts = self._pipe.recv() if self._pipe.poll(START_TIMEOUT_S) else (
                "failed", f"it did not load its model in {START_TIMEOUT_S} s")
        except EOFError:
            self._process.join(5)
            kind, facts = "failed", f"it ended while loading (exit code {self._process.exitcode})"
        if kind == "failed":
            self._process.kill()
            self._process = None
            raise RuntimeError(f"the engine's process could not start: {facts}")
        from deepinfer.loading.tokenizer import load_tokenizer  # the one the engine loaded, for echo

        self.max_model_len, self.vocab_size = facts["max_model_len"], facts["vocab_size"]
        self.counters, self.tokenizer = facts["counters"], load_tokenizer(facts["tokenizer"])
        self._reader = threading.Thread(target=self._read, name="deepinfer-engine-events", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        if self._process is None:
            return
        self._send(None)
        self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join(timeout=5)
        self._pipe.close()
        self._process = None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive() and self.error is None

    def submit(self, submission: Submission) -> None:
        if not self.alive:
            raise APIError(503, f"the engine has stopped: {self.error}", type="server_error")
        with self._lock:
            if len(self._open) >= self.max_queued:
                raise Overloaded(self.max_queued)
            submission.key = next(self._keys)
            try:
                self._pipe.send(("add", submission.key, submission.order()))
            except (BrokenPipeError, OSError) as exc:  # it died since ``alive`` was read
                raise APIError(503, f"the engine's process has gone: {exc!r}", type="server_error") from None
            self._open[submission.key] = (submission, submission.params.n)

    def abort(self, submission: Submission) -> None:
        """The client went away: its samples end and free their cache blocks at the engine's next step boundary."""
        with self._lock:
            if self._open.pop(submission.key, None) is not None:
                self._send_locked(("abort", submission.key))

    def _send(self, message) -> None:
        with self._lock:
            self._send_locked(message)

    def _send_locked(self, message) -> None:
        try:
            self._pipe.send(message)
        except (BrokenPipeError, OSError):  # the process has gone: _read tells the clients waiting
            pass

    def _read(self) -> None:
        """The engine's messages until its process ends: each step's events to their submissions."""
        try:
            while True:
                kind, value = self._pipe.recv()
                if kind == "counters":
                    self.counters = value
                elif kind == "stopped":  # its loop failed: the clients it served were told
                    self.error = value
                else:
                    deliver(self._taken(value))
        except (EOFError, OSError):
            pass
        with self._lock:
            waiting, self._open = [s for s, _ in self._open.values()], {}
        if self._process is not None and self._process.exitcode not in (None, 0):
            self.error = self.error or f"the engine's process ended (exit code {self._process.exitcode})"
        if waiting:  # every client still waiting is told
            deliver([(s, APIError(500, f"the engine's process went away: {self.error}", type="server_error"))
                     for s in waiting])

    def _taken(self, events: list[tuple[int, object]]) -> list[tuple[Submission, object]]:
        """Events by submission; a submission whose samples all finished (or that was refused) is closed."""
        taken = []
        with self._lock:
            for key, event in events:
                entry = self._open.get(key)
                if entry is None:  # aborted: nobody waits for it
                    continue
                submission, open_samples = entry
                taken.append((submission, event))
                open_samples -= isinstance(event, Delta) and event.finish_reason is not None
                if open_samples == 0 or isinstance(event, APIError):
                    del self._open[key]
                else:
                    self._open[key] = (submission, open_samples)
        return taken


def _engine_main(pipe, model: str | None, engine_arguments: dict, warm_up: bool | None) -> None:
    """The engine's process: load, report ("ready", facts) or ("failed", why), then serve orders until told to
    stop (None) or the server's process goes away."""
    from deepinfer.loading.model_source import resolve_model_dir

    lock = threading.Lock()  # the loop's thread and this one both send

    def send(message) -> None:
        with lock:
            pipe.send(message)

    try:
        llm = serving_llm(model, engine_arguments, warm_up)
        loop, config = _PublishingLoop(llm, send), llm.engine.config
    except BaseException as exc:  # its traceback goes to this process's log
        logger.exception("the engine's process could not start")
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    send(("ready", {"max_model_len": loop.max_model_len, "vocab_size": loop.vocab_size, "counters": loop.counters,
                    "tokenizer": str(config.tokenizer or resolve_model_dir(config.model))}))
    loop.start()
    submissions: dict[int, Submission] = {}
    try:
        while (message := pipe.recv()) is not None:
            kind, key, *order = message
            if kind == "add":
                submission = submissions[key] = Submission(**order[0], events=None, loop=None, key=key)
                try:
                    loop.submit(submission)
                except APIError as exc:  # the loop has stopped
                    send(("events", [(key, exc)]))
            elif key in submissions:
                loop.abort(submissions.pop(key))
    except EOFError:  # the server's process went away
        pass
    finally:
        loop.stop()


class _PublishingLoop(EngineLoop):
    """``EngineLoop`` in the engine's process: its events and counters go over the pipe."""

    def __init__(self, llm, send):
        super().__init__(llm, max_queued=1 << 62,  # the server's process keeps the bound
                         send=lambda items: send(("events", [(s.key, event) for s, event in items])))
        self._publish = send
        self._published, self._published_at = None, 0.0

    def _counted(self) -> None:
        counters, now = self.counters, time.monotonic()
        if counters == self._published or (self.engine.has_unfinished()
                                           and now - self._published_at < COUNTERS_EVERY_S):
            return
        self._published, self._published_at = counters, now
        self._publish(("counters", counters))

    def _run(self) -> None:
        super()._run()
        if self.error is not None:
            self._publish(("stopped", f"the engine failed: {self.error!r}"))


def serving_llm(model: str | None, engine_args: dict, warm_up: bool | None):
    """The server's engine, in whichever process runs it: loaded, one rank only, warmed up (``warm_up_server``)."""
    from deepinfer import LLM
    from deepinfer.engine.warm_up import warm_up_server

    llm = LLM(model, **engine_args)
    if llm.ranks is not None:
        raise NotImplementedError("deepinfer serve runs one engine; data/expert/context parallelism is not "
                                  "supported by the server yet")
    warm_up_server(llm, warm_up)
    return llm
