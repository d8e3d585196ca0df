"""The one thread that owns the engine (which is not thread-safe): it admits requests between steps, steps while
any is unfinished, and hands each step's new text to the asyncio queue of the HTTP request that asked for it."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import sys
import threading
from dataclasses import dataclass, field

from deepinfer.logger import init_logger
from deepinfer.outputs import Logprob
from deepinfer.runtime.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.serve.errors import APIError, invalid

logger = init_logger(__name__)

SWITCH_INTERVAL_S = 0.0005  # how long a thread may hold the interpreter lock while another waits for it


@dataclass(slots=True)
class Delta:
    """New output of one sample: ``text`` since the last delta (``num_tokens``: its tokens so far);
    ``finish_reason`` set on its last one."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # (token id, its Logprob entries) for each token since the last delta; None unless logprobs were asked for
    logprobs: list[tuple[int, dict[int, Logprob]]] | None = None


@dataclass(slots=True)
class Admitted:
    num_prompt_tokens: int


@dataclass(eq=False)
class Submission:
    """One prompt's ``n`` samples. ``prompt``: text (tokenized as ``LLM.generate`` does) or token ids.
    ``max_tokens`` None: whatever room the context leaves after the prompt. Events (``Admitted`` or an
    ``APIError`` first, then ``Delta``\\ s), tagged with ``index``, arrive on ``events``, in the event loop that made it."""

    prompt: str | list[int]
    params: SamplingParams
    fill_max_tokens: bool = False
    add_special_tokens: bool = True  # False for a chat encoding, which carries its own BOS (as LLM.chat_prompt)
    name: str = "prompt"
    constrained_by: str = "response_format"  # the HTTP field its params' so_args come from: refusals name it
    images: list = field(default_factory=list)  # a chat's image parts (URLs, data: URLs), one placeholder each
    index: int = 0  # which of its HTTP request's prompts: events go out as (index, event), queues may be shared
    key: int | None = None  # its name between the server's process and the engine's (``engine_process.py``)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    requests: list[Request] = field(default_factory=list)
    shown: list[tuple[int, int]] = field(default_factory=list)  # per sample: (characters, logprobs) sent

    def order(self) -> dict:
        """What the engine needs of it, as plain values (``engine_process.py`` sends them to the engine's
        process, which makes a ``Submission`` of them there)."""
        return {name: getattr(self, name) for name in ("prompt", "params", "fill_max_tokens", "add_special_tokens",
                                                       "name", "constrained_by", "images", "index")}


def deliver(items: list[tuple["Submission", object]]) -> None:
    """Each (submission, event) to its submission's queue, in one callback per event loop: a wake-up of the HTTP
    thread per step, not per stream (64 streams cost 64 self-pipe writes and loop iterations a step otherwise)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for submission, event in items:
        by_loop.setdefault(submission.loop, []).append((submission.events, (submission.index, event)))
    for loop, events in by_loop.items():
        loop.call_soon_threadsafe(_put, events)


def _put(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    for destination, item in events:
        destination.put_nowait(item)


class Overloaded(APIError):
    def __init__(self, bound: int):
        super().__init__(503, f"the server has {bound} requests unfinished (--max-queued); retry later",
                         type="server_overloaded", code="server_overloaded")


class EngineLoop:
    """``submit`` and ``abort`` may be called from any thread; everything else runs on the loop's own thread, which
    hands each step's events to ``send`` (``deliver``: to the submissions' event loops in this process)."""

    def __init__(self, llm, max_queued: int, send=deliver):
        self.llm, self.engine, self.max_queued, self._send = llm, llm.engine, max_queued, send
        self.max_model_len, self.vocab_size = llm.engine.max_model_len, llm.engine.model_config.vocab_size
        self.tokenizer = llm.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0  # submissions not yet finished: what --max-queued bounds
        self._active: list[Submission] = []
        self._stopping = False
        self.counters = self.engine.counters()  # a copy, refreshed by the loop: /metrics reads it from other threads
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine-loop", daemon=True)
        self._switch_interval = sys.getswitchinterval()  # the process's, restored by ``stop``

    def start(self) -> None:
        # the engine thread gives up the interpreter lock at every wait for the device and then needs it back at
        # once; at Python's default 5 ms switch interval a busy HTTP thread (64 streams' server-sent events) may
        # keep it up to 5 ms per hand-back, several times a step (c = 64 on an H100: 22.6 ms a token where offline
        # decoding takes 3.7 ms a step). Restored by ``stop``.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, submission: Submission) -> None:
        if not self.alive:
            raise APIError(503, f"the engine loop has stopped: {self.error!r}", type="server_error")
        with self._lock:
            if self._outstanding >= self.max_queued:
                raise Overloaded(self.max_queued)
            self._outstanding += 1
        self._inbox.put(("add", submission))

    def abort(self, submission: Submission) -> None:
        """The client went away: its samples end and free their cache blocks at the next step boundary."""
        self._inbox.put(("abort", submission))

    # -- the loop thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self.engine.step()
                    self._route()
                self.counters = self.engine.counters()  # also after an abort, which no step may follow
                self._counted()
        except BaseException as exc:  # the server cannot go on without its engine: every waiting client is told
            logger.exception("the engine loop failed")
            self.error = exc
            self._send([(submission, APIError(500, f"the engine failed: {exc!r}", type="server_error"))
                        for submission in self._active])

    def _counted(self) -> None:
        """After each turn of the loop, ``counters`` refreshed (the engine's process publishes them here)."""

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=None) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            kind, submission = item
            if kind == "add":
                self._admit(submission)
            elif submission in self._active:
                self.engine.abort(submission.requests)
                self._done(submission)

    def _admit(self, submission: Submission) -> None:
        try:
            token_ids, images, params = self._checked(submission)
        except APIError as exc:
            self._refuse(submission, exc)
            return
        text = submission.prompt if isinstance(submission.prompt, str) else None
        submission.requests.extend(self.llm.submit(submission.prompt, params, encoded=(text, token_ids, images)))
        submission.shown = [(0, 0)] * params.n
        self._active.append(submission)
        self._send([(submission, Admitted(len(token_ids)))])

    def _checked(self, submission: Submission) -> tuple[list[int], tuple, SamplingParams]:
        """The prompt's token ids (image spans expanded), its images and the params to run, or an ``APIError``
        naming what the engine refuses. Each check's refusal is mapped to its own field here, where it is known
        which check failed."""
        try:
            token_ids = (self.llm.tokenize(submission.prompt, add_special_tokens=submission.add_special_tokens)
                         if isinstance(submission.prompt, str) else list(submission.prompt))
            images = ()
            if submission.images:
                token_ids, images = self.engine.prepare_images(token_ids, submission.images, submission.name)
            self.engine.check_prompt(token_ids, submission.name, images)
        except (ValueError, NotImplementedError) as exc:  # the messages open with submission.name
            raise invalid(str(exc)) from None
        params = submission.params
        try:
            params.check_vocabulary(self.vocab_size)
        except ValueError as exc:
            raise invalid(str(exc), "logit_bias") from None
        if submission.fill_max_tokens:
            params = dataclasses.replace(params, max_tokens=self.engine.max_model_len - len(token_ids))
        if params.so_args is not None:
            field = submission.constrained_by
            if params.min_tokens:
                raise invalid(f"{field} cannot be combined with min_tokens", field)
            try:  # the plugin missing, or a schema it cannot compile
                self.engine.structured_outputs().validate(params.so_args)
            except (ValueError, NotImplementedError) as exc:
                raise invalid(str(exc), field) from None
        return token_ids, images, params

    def _refuse(self, submission: Submission, error: APIError) -> None:
        with self._lock:
            self._outstanding -= 1
        self._send([(submission, error)])

    def _route(self) -> None:
        """Each step's new text (and logprobs, and ends) as one ``Delta`` a sample, all of them sent at once."""
        outbox = []
        for submission in list(self._active):
            for request in submission.requests:
                text, (shown, shown_logprobs) = request.detokenizer.text, submission.shown[request.sample_index]
                if shown < 0:  # its last delta went out
                    continue
                # logprobs are booked as each token resolves, which may be a step after it was sampled (asynchronous
                # scheduling): they are counted on their own, not by num_output_tokens
                booked = 0 if request.logprobs is None else len(request.logprobs)
                if len(text) > shown or booked > shown_logprobs or request.finished:
                    logprobs = None if request.logprobs is None else list(zip(
                        request.output_token_ids[shown_logprobs:booked], request.logprobs[shown_logprobs:booked]))
                    outbox.append((submission, Delta(request.sample_index, text[shown:], request.num_output_tokens,
                                                     request.finish_reason if request.finished else None,
                                                     request.stop_reason, logprobs)))
                    submission.shown[request.sample_index] = (-1, -1) if request.finished else (len(text), booked)
            if all(r.finished for r in submission.requests):
                self._done(submission)
        if outbox:
            self._send(outbox)

    def _done(self, submission: Submission) -> None:
        self._active.remove(submission)
        with self._lock:
            self._outstanding -= 1
