"""Loading the model's tokenizer and turning generated ids into text one step at a time."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded together with the first generated ones, so that decoders which treat
# the start of a text specially (e.g. dropping a leading space) see the same context as a full decode.
_PROMPT_CONTEXT_TOKENS = 5


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of ``model_dir``: via ``AutoTokenizer``, else straight from its ``tokenizer.json``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"cannot load a tokenizer from {model_dir}: not a directory")
    try:
        # Local only: an offline engine must not turn a mistyped path into a hub download. transformers reads
        # config.json too and warns that V4.1's nested configs are "a model of type ``": not about the tokenizer.
        with _transformers_errors_only():
            return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as auto_error:
        # Checkpoints may ship a tokenizer.json without a config transformers understands.
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"cannot load a tokenizer from {model_dir}: AutoTokenizer failed ({auto_error}) "
                "and there is no tokenizer.json"
            ) from auto_error
        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
        except Exception as file_error:
            raise ValueError(
                f"cannot load a tokenizer from {model_dir}: AutoTokenizer failed ({auto_error}) "
                f"and {tokenizer_file} failed ({file_error})"
            ) from file_error


@contextlib.contextmanager
def _transformers_errors_only():
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def ids_to_text(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` without cleaning up spaces, as a function of the ids. A fast tokenizer whose class keeps
    transformers' own ``_decode`` decodes straight through its Rust tokenizer, which is all that ``_decode`` does
    then: detokenizing runs twice per generated token, and transformers' argument handling around it took 4/5 of
    its time."""
    if isinstance(tokenizer, PreTrainedTokenizerFast) and type(tokenizer)._decode is PreTrainedTokenizerFast._decode:
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


class DetokenizerStep(NamedTuple):
    text_delta: str  # text that became final in this step
    stop_string: str | None  # the stop string that ended the sequence, if one did


class IncrementalDetokenizer:
    """Text of one generated sequence, fed token ids step by step.

    Only text that can no longer change is released: bytes of an unfinished character wait for
    the tokens that complete them, and a tail that could still grow into a stop string waits
    until it either becomes one or cannot. So the deltas concatenate to the final text, and a
    stop string split across tokens or steps is found. Stop strings are searched in generated
    text only; when one appears the text ends right before it (or right after it with
    ``include_stop_str_in_output``) and the detokenizer accepts no more tokens. When the
    sequence ends for another reason (EOS, stop token, length), ``finish`` releases what waits.
    """

    __slots__ = (
        "_decode",
        "_stop",
        "_include_stop_str",
        "_token_ids",
        "_read_offset",
        "_text",
        "_released",
        "_finished",
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = ids_to_text(tokenizer, skip_special_tokens)
        self._stop = tuple(stop)
        self._include_stop_str = include_stop_str_in_output
        # _token_ids = context ids, already text (or prompt), re-decoded only so that the pending
        # ids after them decode with the same neighbours as in a full decode; then pending ids.
        self._token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._token_ids)
        self._text = ""  # generated text decoded so far, cut at the stop string once found
        self._released = 0  # length of the prefix of _text already returned
        self._finished = False

    @property
    def text(self) -> str:
        """Generated text released so far (everything after ``finish`` or a stop string); ids whose decoding
        waited (no stop strings to search) are decoded now."""
        if not self._finished and len(self._token_ids) > self._read_offset:
            self._advance(self._decode_pending(final=False), final=False)
        return self._text[: self._released]

    @property
    def finished(self) -> bool:
        return self._finished

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerStep:
        """Add the ids generated in one step; return the newly final text and any stop string hit. Without stop
        strings nothing needs the text yet: the ids wait, decoded when ``text`` is read or at ``finish`` (two
        decodes per generated token were most of a large decode step's output processing)."""
        if self._finished:
            raise RuntimeError("the sequence already ended; no more tokens can be added")
        self._token_ids.extend(new_token_ids)
        if not self._stop:
            return DetokenizerStep("", None)
        decoded = self._decode_pending(final=False)
        return self._advance(decoded, final=False)

    def finish(self) -> DetokenizerStep:
        """End the sequence: release the waiting text, including incomplete characters as U+FFFD."""
        if self._finished:
            return DetokenizerStep("", None)
        decoded = self._decode_pending(final=True)
        return self._advance(decoded, final=True)

    def _decode_pending(self, final: bool) -> str:
        context_text = self._decode(self._token_ids[: self._read_offset])
        full_text = self._decode(self._token_ids)
        # A trailing U+FFFD means the last token ends inside a character: wait for the rest.
        if len(full_text) <= len(context_text) or (full_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        # The ids just decoded become the context of the next step; older ones are not needed again.
        del self._token_ids[: self._read_offset]
        self._read_offset = len(self._token_ids)
        return full_text[len(context_text) :]

    def _advance(self, decoded: str, final: bool) -> DetokenizerStep:
        searched_from = len(self._text)
        self._text += decoded
        stop_string, end = self._first_stop(searched_from)
        if stop_string is not None:
            self._text = self._text[: end if self._include_stop_str else end - len(stop_string)]
            releasable = len(self._text)
            self._finished = True
        elif final:
            releasable = len(self._text)
            self._finished = True
        else:
            releasable = len(self._text) - self._stop_prefix_length()
        delta = self._text[self._released : releasable]
        self._released = releasable
        return DetokenizerStep(delta, stop_string)

    def _first_stop(self, searched_from: int) -> tuple[str | None, int]:
        """The stop string completed first by the text added after ``searched_from``, and its end.

        Earlier text held no stop string, so a new match must end after ``searched_from``. When
        several complete at the same character the one listed first wins.
        """
        best: str | None = None
        best_end = -1
        for stop in self._stop:
            start = self._text.find(stop, max(0, searched_from - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best_end):
                best, best_end = stop, start + len(stop)
        return best, best_end

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest_candidate = min(max((len(s) for s in self._stop), default=1) - 1, len(self._text))
        for length in range(longest_candidate, 0, -1):
            tail = self._text[-length:]
            if any(len(stop) > length and stop.startswith(tail) for stop in self._stop):
                return length
        return 0
