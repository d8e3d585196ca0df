"""Per-request generation settings, named as in vLLM so existing call sites carry over."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

_MAX_SEED = 2**63 - 1  # seeds travel in int64 tensors where -1 means "unseeded"
_SCHEMA_TYPES = ("json", "regex", "ebnf")


@dataclass(slots=True)
class SamplingParams:
    """How to generate the completions of one prompt.

    ``temperature`` 0 is greedy. ``top_k`` 0 or -1, ``top_p`` 1.0 and ``min_p`` 0.0 are off.
    ``logprobs`` is the number of top log-probabilities returned per generated token (-1: the
    whole vocabulary). ``seq_seed`` makes sampling a pure function of (seed, output position,
    token id), independent of batch mates. ``logit_bias`` maps token ids to a bias in [-100, 100]
    added to their logits before sampling, greedy included (OpenAI's ``logit_bias``: -100 in effect
    bans a token, +100 all but forces it); the engine checks the ids against its vocabulary.
    ``so_args`` = ``{"schema_type": "json"|"regex"|"ebnf",
    "schema": ...}`` asks the structured-outputs plugin to constrain the output.

    After construction ``stop`` and ``stop_token_ids`` are always lists (a single stop string
    becomes a one-element list, ``None`` an empty list); they are copies, so later changes to
    the caller's lists do not leak in (``logit_bias`` is a copy too). No other value is changed:
    anything out of range raises ``ValueError`` naming the field and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seq_seed: int | None = None
    logit_bias: dict[int, float] | None = None
    so_args: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_stop_conditions()
        self._check_flags()
        if self.so_args is not None:
            _check_so_args(self.so_args)
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuses ``logit_bias`` ids the model has no logit for (the sampler would index past the vocabulary)."""
        outside = sorted(t for t in self.logit_bias or () if t >= vocab_size)
        if outside:
            raise ValueError(f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def _check_numbers(self) -> None:
        _check_int("n", self.n, "n must be >= 1", lambda v: v >= 1)
        _check_real("temperature", self.temperature, "temperature must be >= 0", lambda v: v >= 0)
        if self.greedy and self.n > 1:
            raise ValueError(f"n must be 1 when temperature is 0 (greedy), got {self.n}")
        _check_real("top_p", self.top_p, "top_p must be in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, "top_k must be -1 or 0 (off) or >= 1", lambda v: v >= -1)
        _check_real("min_p", self.min_p, "min_p must be in [0, 1]", lambda v: 0 <= v <= 1)
        _check_int("max_tokens", self.max_tokens, "max_tokens must be >= 1", lambda v: v >= 1)
        _check_int("min_tokens", self.min_tokens, "min_tokens must be >= 0", lambda v: v >= 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, "logprobs must be None, -1 (whole vocabulary) or >= 0", lambda v: v >= -1)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), f"{name} must be in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_real("repetition_penalty", self.repetition_penalty, "repetition_penalty must be > 0", lambda v: v > 0)
        if self.seq_seed is not None:
            _check_int("seq_seed", self.seq_seed, "seq_seed must be None or in [0, 2**63 - 1]", lambda v: 0 <= v <= _MAX_SEED)

    def _check_stop_conditions(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a str or a list of non-empty str, got {stop!r}")
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a str or a list of non-empty str, got {self.stop!r}")
        self.stop = list(stop)

        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative int, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)

    def _check_flags(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a count is almost certainly a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, rule: str, in_range: Callable[[int], bool]) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not in_range(value):
        raise ValueError(f"{rule}, got {value!r}")


def _check_real(name: str, value: object, rule: str, in_range: Callable[[float], bool]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not in_range(value):
        raise ValueError(f"{rule}, got {value!r}")


MAX_LOGIT_BIAS = 100.0  # OpenAI's bound


def _checked_logit_bias(logit_bias: object) -> dict[int, float]:
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    for token_id, bias in logit_bias.items():
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (int >= 0), got {token_id!r}")
        _check_real(f"logit_bias[{token_id}]", bias, f"logit_bias[{token_id}] must be in [-100, 100]",
                    lambda v: -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS)
    return dict(logit_bias)


def _check_so_args(so_args: object) -> None:
    """Shape only: whether the schema can be enforced is the structured-outputs plugin's call."""
    if not isinstance(so_args, dict) or set(so_args) != {"schema_type", "schema"}:
        raise ValueError(f'so_args must be a dict with exactly the keys "schema_type" and "schema", got {so_args!r}')
    schema_type, schema = so_args["schema_type"], so_args["schema"]
    if schema_type not in _SCHEMA_TYPES:
        raise ValueError(f"so_args['schema_type'] must be one of {', '.join(_SCHEMA_TYPES)}, got {schema_type!r}")
    # A JSON schema may come parsed or as text; regex and EBNF grammars are always text.
    allowed = (str, dict) if schema_type == "json" else (str,)
    if not isinstance(schema, allowed):
        raise ValueError(
            f"so_args['schema'] must be {' or '.join(t.__name__ for t in allowed)} for schema_type "
            f"{schema_type!r}, got {type(schema).__name__}"
        )
