"""Every ``DEEPINFER_*`` environment variable, declared once, parsed once.

To add a variable, add one field to ``Envs`` below; the registry (``VARIABLES``), the
validation and the table in docs/configuration.md (``python -m deepinfer.envs``) all derive from it.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

# Not deepinfer.logger: that module takes its level from these variables, so it cannot be
# configured before they are parsed. Records still reach its handler once it exists.
_logger = logging.getLogger("deepinfer.envs")

PREFIX = "DEEPINFER_"

Kind = Literal["bool", "int", "str", "choice", "path"]

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def _variable(
    kind: Kind,
    default: object,
    meaning: str,
    *,
    choices: tuple[str, ...] = (),
    minimum: int | None = None,
) -> Any:
    """Declare a variable; its name is the ``Envs`` field it is assigned to."""
    spec = {"kind": kind, "meaning": meaning, "choices": choices, "minimum": minimum}
    return field(default=default, metadata=spec)


@dataclass(frozen=True, slots=True)
class Envs:
    """The parsed environment; attribute names are the variable names, so they grep."""

    DEEPINFER_ACCELERATOR: str = _variable(
        "choice", "auto", "Device family the engine uses (build.sh reads it too).",
        choices=("auto", "cpu", "nvidia", "ascend"),
    )
    DEEPINFER_KERNELS: str = _variable(
        "str", "auto", "build.sh (nvidia): where DeepSeek's kernels come from: `auto`, `triton`, "
        "`source:DIR`, `prebuilt:DIR`, `pypi[:VLLM_VERSION]` (see build.sh). At run time `triton` leaves "
        "FlashMLA, DeepGEMM and humming-kernels unused even where they are installed.",
    )
    DEEPINFER_HF_MODEL_DIR: Path | None = _variable(
        "path", None, "Local checkpoint directory; overrides the model argument and the hub default.",
    )
    DEEPINFER_PLUGINS: str | None = _variable(
        "str", None,
        "Entry-point plugins to load: unset loads all, empty loads none, a comma list loads those names.",
    )
    DEEPINFER_ENABLE_MTP_VARLEN: bool | None = _variable(
        "bool", None, "Speculative decoding (features/mtp), on when set: `1` verifies per request the draft prefix "
        "its confidence and the step's load justify (the load as DEEPINFER_SPECULATION_POLICY prices it), `0` every "
        "draft up to the maximum draft length. Unset: off.",
    )
    DEEPINFER_SPECULATION_POLICY: str = _variable(
        "choice", "measured", "With `DEEPINFER_ENABLE_MTP_VARLEN=1`, how each step's draft length is picked: `measured` "
        "times steps and counts acceptance per draft position, and picks the length (0: plain decoding, no draft "
        "pass) with the most expected tokens per second; `floor` verifies the prefix whose confidence clears a "
        "floor rising with the step's load. Ignored otherwise.",
        choices=("measured", "floor"),
    )
    DEEPINFER_USE_NEXTN_DECODE: int = _variable(
        "int", 5, "Most draft tokens a step verifies per request, when a drafter plugin serves the model.", minimum=1,
    )
    DEEPINFER_DRAFT_VOCAB: Path | None = _variable(
        "path", None, "DSpark drafts only from the token ids in this file (`deepinfer draft-vocab` writes one): each "
        "draft pass reads the vocabulary and Markov heads' rows of those tokens alone. Outputs do not change; a "
        "token outside the file is never drafted. Unset: the whole vocabulary. Unused (with a warning) without "
        "speculative decoding.",
    )
    DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE: str = _variable(
        "choice", "off", "SWA-bounded replay of the decoder layers during prefill.",
        choices=("off", "compact"),
    )
    DEEPINFER_YOCO_PREFILL_KEEP_TOKENS: int = _variable(
        "int", 140, "Suffix the decoder layers replay; must cover the SWA window plus the longest backtrack.", minimum=1,
    )
    DEEPINFER_BATCH_INVARIANT: bool = _variable(
        "bool", False, "Batch-invariant mode (features/batch_invariant): a request's tokens and logprobs are bitwise the "
        "same whatever else shares its batch and however its prompt is chunked.",
    )
    DEEPINFER_ASYNC_SCHEDULING: bool = _variable(
        "bool", True, "Schedule and launch the next step before the host has the current step's tokens (off: wait).",
    )
    DEEPINFER_DEPENDENT_LAUNCH: bool = _variable(
        "bool", True, "nvidia, SM90 and later: launch the Triton kernels with programmatic dependent launch (a kernel's "
        "programs start while the one before it finishes, and wait for its writes). Off: one after another, as "
        "tools such as compute-sanitizer expect.",
    )
    DEEPINFER_ENGRAM_TABLES: str = _variable(
        "choice", "auto", "Where DeepSeek-V4.1's Engram tables are read: `device` hashes and gathers inside each step "
        "(CUDA graphs; the step needs no token values on the host), `host` keeps them memory-mapped and gathers on "
        "the host (the next step waits for the previous one's tokens), `auto` picks `device` when the tables take "
        "at most an eighth of its memory (the released V4.1-Flash's 196 GB stay on the host).",
        choices=("auto", "device", "host"),
    )
    DEEPINFER_LOGGING_LEVEL: str = _variable(
        "choice", "INFO", "Level of the `deepinfer` loggers.",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
    )
    DEEPINFER_TRACE_PLUGINS: bool = _variable(
        "bool", False, "Log every hook call, the plugins asked and their answers (at DEBUG).",
    )


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: its type, default, meaning and what values it accepts."""

    name: str
    kind: Kind
    default: object
    meaning: str
    choices: tuple[str, ...]
    minimum: int | None

    def allowed(self) -> str:
        if self.kind == "bool":
            return "one of " + ", ".join(_TRUE_WORDS + _FALSE_WORDS) + " (any case)"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "int":
            return "an integer" if self.minimum is None else f"an integer >= {self.minimum}"
        if self.kind == "path":
            return "a non-empty filesystem path"
        return "any string"

    def type_label(self) -> str:
        if self.kind == "choice":
            return " \\| ".join(f"`{choice}`" for choice in self.choices)
        if self.kind == "int" and self.minimum is not None:
            return f"int ≥ {self.minimum}"
        return self.kind

    def parse(self, raw: str) -> object:
        value = self._convert(raw)
        if value is None:
            raise ValueError(f"{self.name}={raw!r} is invalid: expected {self.allowed()}")
        return value

    def _convert(self, raw: str) -> object | None:
        """The typed value, or ``None`` when ``raw`` is not acceptable."""
        if self.kind == "str":
            return raw
        text = raw.strip()
        if self.kind == "path":
            return Path(text).expanduser() if text else None
        if self.kind == "bool":
            if text.lower() in _TRUE_WORDS:
                return True
            return False if text.lower() in _FALSE_WORDS else None
        if self.kind == "choice":
            # Users type `debug` as often as `DEBUG`; store the canonical spelling.
            matches = [choice for choice in self.choices if choice.lower() == text.lower()]
            return matches[0] if matches else None
        try:
            number = int(text)
        except ValueError:
            return None
        return number if self.minimum is None or number >= self.minimum else None


VARIABLES: tuple[EnvVar, ...] = tuple(
    EnvVar(name=spec.name, default=spec.default, **spec.metadata) for spec in fields(Envs)
)


def _parse(environ: Mapping[str, str]) -> Envs:
    known = [variable.name for variable in VARIABLES]
    for name in sorted(environ):
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            _logger.warning("unknown environment variable %s is ignored%s", name, hint)
    values = {v.name: v.parse(environ[v.name]) for v in VARIABLES if v.name in environ}
    return Envs(**values)


@functools.cache
def get() -> Envs:
    """The environment as parsed on first use; later changes to ``os.environ`` are not seen."""
    return _parse(os.environ)


def reload() -> Envs:
    """Parse ``os.environ`` again (for tests that change it)."""
    get.cache_clear()
    return get()


def _default_label(variable: EnvVar) -> str:
    if variable.default is None:
        return "unset"
    if isinstance(variable.default, bool):
        return "`1`" if variable.default else "`0`"
    return f"`{variable.default}`"


def markdown_table() -> str:
    """The table of environment variables in docs/configuration.md."""
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for variable in VARIABLES:
        cells = (f"`{variable.name}`", variable.type_label(), _default_label(variable), variable.meaning)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
