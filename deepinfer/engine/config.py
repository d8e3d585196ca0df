"""Engine arguments (vLLM's names where they exist), validated when the engine is built."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

import torch

from deepinfer import envs
from deepinfer.runtime.devices import resolve_device

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICES = ("auto", "cpu", "cuda", "npu")
# auto: weights stay as the checkpoint stores them; none: FP8/MXFP4 weights are dequantized to `dtype` when loaded
_QUANTIZATION = ("auto", "none")
# auto: read the checkpoint; dummy: random weights in the released formats, for benchmarks without files
_LOAD_FORMATS = ("auto", "dummy")
# auto: attention KV rows in the model's dtype; fp8: DeepSeek-V4's FP8 layout (deepinfer.runtime.fp8_kv), 584 bytes a row
_KV_CACHE_DTYPES = ("auto", "fp8")
# auto: decode steps replay captured CUDA graphs on CUDA (unless enforce_eager); padded-eager: on any device they are
# padded as a graph replays them but run eagerly, which is how CPU tests run the graph paths' code
_CUDA_GRAPHS = ("auto", "padded-eager")


def _from_environment(variable: str):
    """A field whose default is the documented variable's value (``deepinfer/envs.py``), read when the config is
    built: the one place the engine's features take their defaults from the environment."""
    return field(default_factory=lambda: getattr(envs.get(), variable), metadata={"variable": variable})


def _check_variable_field(name: str, value, variable: envs.EnvVar) -> None:
    """A value given for a field that a variable defaults must be one that variable could give."""
    if variable.kind == "bool":
        ok = isinstance(value, bool) or (value is None and variable.default is None)
    elif variable.kind == "path":
        ok = value is None or (isinstance(value, (str, os.PathLike)) and str(value) != "")
    elif variable.kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and (variable.minimum is None
                                                                          or value >= variable.minimum)
    else:
        ok = value in variable.choices
    if not ok:
        unset = " or None" if variable.default is None else ""
        raise ValueError(f"{name} ({variable.name}'s value by default) must be {variable.allowed()}{unset}, "
                         f"got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_size: int | None = None
    num_cache_tokens: int | None = None
    kv_cache_memory_gb: float = 4.0
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    cuda_graphs: str = "auto"
    seed: int = 0
    # parallelism (deepinfer.parallel): ranks = data_parallel_size; experts sharded over them when
    # enable_expert_parallel, placed by measured load when enable_eplb
    data_parallel_size: int = 1
    context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_step_interval: int = 256
    # the device family and the features, each defaulting to its DEEPINFER_* variable (what each means: the
    # README's table of variables).
    accelerator: str = _from_environment("DEEPINFER_ACCELERATOR")
    # speculative decoding: None off, True confidence-scheduled draft lengths, False fixed length
    enable_mtp_varlen: bool | None = _from_environment("DEEPINFER_ENABLE_MTP_VARLEN")
    # with enable_mtp_varlen=True: "measured" step draft lengths from timed steps, "floor" the load-based floor
    speculation_policy: str = _from_environment("DEEPINFER_SPECULATION_POLICY")
    num_speculative_tokens: int = _from_environment("DEEPINFER_USE_NEXTN_DECODE")
    # DSpark drafts only from these token ids (a file: loading/draft_vocab.py); None: the whole vocabulary
    draft_vocab: str | os.PathLike | None = _from_environment("DEEPINFER_DRAFT_VOCAB")
    # benchmarks only: accept drafts at random so that the mean acceptance length is this (engine/speculation.py);
    # outputs are then not the target model's
    synthetic_acceptance_length: float | None = None
    prefill_truncation_mode: str = _from_environment("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")
    prefill_keep_tokens: int = _from_environment("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS")
    batch_invariant: bool = _from_environment("DEEPINFER_BATCH_INVARIANT")
    async_scheduling: bool = _from_environment("DEEPINFER_ASYNC_SCHEDULING")
    engram_tables: str = _from_environment("DEEPINFER_ENGRAM_TABLES")

    def __post_init__(self):
        for name, allowed in (("dtype", _DTYPES), ("quantization", _QUANTIZATION), ("kv_cache_dtype", _KV_CACHE_DTYPES),
                              ("load_format", _LOAD_FORMATS)):
            if not isinstance(getattr(self, name), str):  # a list would fail the membership test as unhashable
                raise ValueError(f"{name} must be one of {sorted(allowed)}, got {getattr(self, name)!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.quantization not in _QUANTIZATION:
            raise ValueError(f"quantization must be one of {_QUANTIZATION} ('none' dequantizes FP8/MXFP4 weights to "
                             f"dtype when loading), got {self.quantization!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES} (fp8: DeepSeek-V4's 584-byte FP8 "
                             f"attention rows), got {self.kv_cache_dtype!r}")
        if self.cuda_graphs not in _CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {_CUDA_GRAPHS} (padded-eager: decode steps padded as CUDA "
                             f"graphs replay them, run eagerly), got {self.cuda_graphs!r}")
        if self.cuda_graphs == "padded-eager" and self.context_parallel_size > 1:
            raise ValueError("cuda_graphs='padded-eager' pads steps as graphs do, and context parallelism splits a "
                             "step by its requests, which a padded step does not: use one or the other")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.device not in _DEVICES and not str(self.device).startswith(("cuda:", "npu:")):
            raise ValueError(f"device must be one of {_DEVICES} (or cuda:N / npu:N), got {self.device!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"tokenizer must be a path or repo id (str) or None, got {self.tokenizer!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "data_parallel_size", "context_parallel_size",
                     "eplb_step_interval"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("max_model_len", "block_size", "num_cache_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        for name in ("enforce_eager", "enable_expert_parallel", "enable_eplb", "enable_chunked_prefill",
                     "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _is_int(self.num_redundant_experts) or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be an integer >= 0, got {self.num_redundant_experts!r}")
        # torch.manual_seed takes a uint64 and fails deep inside the engine on anything else
        if not _is_int(self.seed) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        value = self.kv_cache_memory_gb
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"kv_cache_memory_gb must be a finite number > 0, got {value!r}")
        if self.context_parallel_size > 1 and (self.data_parallel_size > 1 or self.enable_expert_parallel):
            raise ValueError("context_parallel_size > 1 runs alone for now: combine it with neither data_parallel_size "
                             "> 1 nor enable_expert_parallel")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb=True needs enable_expert_parallel=True (EPLB places experts over the "
                             "expert-parallel ranks)")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError(f"num_redundant_experts={self.num_redundant_experts} needs enable_eplb=True (redundant "
                             "experts are replicas EPLB places by measured load)")
        variables = {variable.name: variable for variable in envs.VARIABLES}
        for f in fields(self):
            if "variable" in f.metadata:
                _check_variable_field(f.name, getattr(self, f.name), variables[f.metadata["variable"]])
        length = self.synthetic_acceptance_length
        if length is not None:  # after the variables' check: the bound needs a valid num_speculative_tokens
            bound = self.num_speculative_tokens + 1
            if isinstance(length, bool) or not isinstance(length, (int, float)) or not 1 <= length <= bound:
                raise ValueError(f"synthetic_acceptance_length must be a number in [1, {bound}] (1 + "
                                 f"num_speculative_tokens={self.num_speculative_tokens}) or None, got {length!r}")

    @staticmethod
    def variable_of(name: str) -> str:
        """The DEEPINFER_* variable a field takes its default from."""
        return next(f.metadata["variable"] for f in fields(EngineConfig) if f.name == name)

    @property
    def world_size(self) -> int:
        """Ranks of the job: one per data-parallel rank and context-parallel share."""
        return self.data_parallel_size * self.context_parallel_size

    @classmethod
    def from_kwargs(cls, model: str | None, engine_args: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known - {'model'})}")
        return cls(model=model, **engine_args)

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """``auto`` keeps the checkpoint's dtype (its ``torch_dtype``)."""
        return checkpoint_dtype if self.dtype == "auto" else _DTYPES[self.dtype]

    def torch_device(self) -> torch.device:
        return resolve_device(self.device, self.accelerator)


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a count or a size is a mistake, not 1
    return isinstance(value, int) and not isinstance(value, bool)
