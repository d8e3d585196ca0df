"""Reading a safetensors checkpoint one shard at a time into the model's canonical state dict."""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer.core.quantization import dequantize
from deepinfer.models.deepseek_v4.weight_names import canonical_name, expert_slot, split_fused_experts

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# A real mismatch can involve thousands of tensors; the first few of each kind say what went wrong.
_MAX_LISTED = 20

TensorSpec = tuple[tuple[int, ...], torch.dtype]


@dataclass(slots=True)
class CheckpointIndex:
    directory: Path
    files: list[str]

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> CheckpointIndex:
        """The shards named by the index.json, else model.safetensors alone, else every *.safetensors file."""
        directory = Path(path)
        index_file = directory / INDEX_FILE
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_file} has no 'weight_map' object")
            files = sorted(set(weight_map.values()))
            absent = [f for f in files if not (directory / f).is_file()]
            if absent:
                raise FileNotFoundError(f"{index_file} names shards that are not in {directory}: {absent}")
            return cls(directory, files)
        if (directory / SINGLE_FILE).is_file():
            return cls(directory, [SINGLE_FILE])
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"No *.safetensors checkpoint in {directory}")
        return cls(directory, files)

    @property
    def total_bytes(self) -> int:
        return sum((self.directory / f).stat().st_size for f in self.files)

    def iter_tensors(self, progress: bool = False, memory_mapped: Callable[[str], bool] | None = None,
                     ) -> Iterator[tuple[str, torch.Tensor, str]]:
        """(name, tensor, shard file name) for every tensor, shard by shard; only one tensor is read at a time.

        Each shard's own header lists its tensors, so an index.json is only used to find the shards. Tensors whose
        name ``memory_mapped`` accepts are not read: they come back as read-only views of the mapped file.
        """
        bar = tqdm(total=self.total_bytes, unit="B", unit_scale=True, desc="Loading weights", disable=not progress)
        with bar:
            for file in self.files:
                path = self.directory / file
                with safe_open(path, framework="pt", device="cpu") as shard:
                    for name in shard.keys():
                        if memory_mapped is not None and memory_mapped(name):
                            yield name, _mapped_tensor(path, name), file
                        else:
                            yield name, shard.get_tensor(name), file
                bar.update(path.stat().st_size)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _mapped_tensor(path: Path, name: str) -> torch.Tensor:
    """A tensor backed by the file's pages (read-only mapping): nothing is read until it is indexed."""
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(header_len))[name]
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    begin, end = entry["data_offsets"]
    dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
    with warnings.catch_warnings():  # read-only on purpose: the checkpoint must never be written through
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(memoryview(mapping), dtype=torch.uint8, count=end - begin, offset=8 + header_len + begin)
    return raw.view(dtype).view(entry["shape"])


@dataclass(slots=True)
class _Mismatches:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    misshaped: list[str] = field(default_factory=list)
    # Present but wrongly shaped, so not also "missing".
    misshaped_names: set[str] = field(default_factory=set)

    def add_misshaped(self, name: str, source: str, got: torch.Size, wanted: tuple[int, ...]) -> None:
        self.misshaped.append(f"{source}: got {tuple(got)}, expected {tuple(wanted)}")
        self.misshaped_names.add(name)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.misshaped)

    def error(self, model_dir: Path) -> ValueError:
        lines = [f"Checkpoint in {model_dir} does not match the model:"]
        for title, entries in (("missing", self.missing), ("unexpected", self.unexpected),
                               ("mis-shaped", self.misshaped)):
            if entries:
                lines.append(f"  {title} tensors ({len(entries)}):")
                lines += [f"    {entry}" for entry in entries[:_MAX_LISTED]]
                if len(entries) > _MAX_LISTED:
                    lines.append(f"    ... and {len(entries) - _MAX_LISTED} more")
        return ValueError("\n".join(lines))


def _source(name: str, checkpoint_name: str, file: str) -> str:
    if name == checkpoint_name:
        return f"{name} (in {file})"
    return f"{name} (from {checkpoint_name} in {file})"


def load_state_dict(
    model_dir: str | os.PathLike[str],
    expected: dict[str, TensorSpec],
    *,
    canonical: Callable[[str], str | None] = canonical_name,
    memory_mapped: Callable[[str], bool] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under canonical names, shaped and typed as ``expected`` says.

    ``canonical`` maps checkpoint names onto the model's (None: not loaded). A quantized weight (FP8 or packed
    MXFP4 with a ``.scale`` partner) that ``expected`` wants in a float dtype is dequantized once both halves have
    arrived. ``memory_mapped`` names are returned as views of the file; ``keep`` names are returned as stored,
    unchecked (the model keeps them for a later feature).

    Per-expert tensors are stacked into the expected [E, ...] tensor as they arrive, so peak memory is the result
    plus one checkpoint tensor. Raises one ValueError listing every missing, unexpected and mis-shaped tensor.
    """
    model_dir = Path(model_dir)
    loaded: dict[str, torch.Tensor] = {}
    experts_seen: dict[str, set[int]] = {}
    halves: dict[str, dict[str, tuple[torch.Tensor, str]]] = {}  # quantized weight -> {"weight"/"scale": ...}
    mismatches = _Mismatches()
    skipped = 0

    def place(name: str, tensor: torch.Tensor, source: str) -> None:
        slot = expert_slot(name)
        if slot is None:
            _place_whole(name, tensor, source, expected, loaded, mismatches)
        else:
            _place_expert(name, *slot, tensor, source, expected, loaded, experts_seen, mismatches)

    index = CheckpointIndex.from_dir(model_dir)
    for checkpoint_name, tensor, file in index.iter_tensors(progress=True, memory_mapped=memory_mapped):
        if keep is not None and keep(checkpoint_name):
            loaded[checkpoint_name] = tensor
            continue
        name = canonical(checkpoint_name)
        if name is None:
            skipped += 1
            continue
        for name, part in split_fused_experts(name, tensor):
            source = _source(name, checkpoint_name, file)
            base, _, leaf = name.rpartition(".")
            if _wants_dequantized(name, part, expected):
                pair = halves.setdefault(base, {})
                pair[leaf] = (part, source)
                if len(pair) == 2:
                    del halves[base]
                    place(f"{base}.weight", _dequantize_pair(pair, _expected_dtype(f"{base}.weight", expected)),
                          pair["weight"][1])
            else:
                place(name, part, source)
    for base, pair in halves.items():
        (leaf, (_, source)), = pair.items()
        other = "scale" if leaf == "weight" else "weight"
        mismatches.unexpected.append(f"{source}: its {base}.{other} is missing from the checkpoint")
    if skipped:
        logger.debug("Skipped %d tensors in %s that this model does not use", skipped, model_dir)
    mismatches.missing += [n for n in expected if n not in loaded and n not in mismatches.misshaped_names]
    for stacked, seen in experts_seen.items():
        prefix, leaf = stacked.rsplit(".experts.", 1)
        absent = (f"{prefix}.experts.{e}.{leaf}" for e in range(len(loaded[stacked])) if e not in seen)
        mismatches.missing += [n for n in absent if n not in mismatches.misshaped_names]
    if mismatches:
        raise mismatches.error(model_dir)
    return loaded


def _expected_dtype(name: str, expected: dict[str, TensorSpec]) -> torch.dtype | None:
    slot = expert_slot(name)
    spec = expected.get(name if slot is None else slot[0])
    return None if spec is None else spec[1]


def _wants_dequantized(name: str, tensor: torch.Tensor, expected: dict[str, TensorSpec]) -> bool:
    """A quantized weight or its scale, for a model that wants the weight in a float dtype."""
    base, _, leaf = name.rpartition(".")
    if leaf == "scale":
        return _expected_dtype(name, expected) is None and _expected_dtype(f"{base}.weight", expected) is not None
    wanted = _expected_dtype(name, expected)
    return leaf == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.int8) and wanted is not None \
        and wanted.is_floating_point and wanted.itemsize > 1


def _dequantize_pair(pair: dict[str, tuple[torch.Tensor, str]], dtype: torch.dtype) -> torch.Tensor:
    (weight, source), (scale, _) = pair["weight"], pair["scale"]
    try:
        return dequantize(weight, scale, dtype)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def _place_whole(name: str, tensor: torch.Tensor, source: str, expected: dict[str, TensorSpec],
                 loaded: dict[str, torch.Tensor], mismatches: _Mismatches) -> None:
    if name in loaded:
        mismatches.unexpected.append(f"{source}: loaded twice")
        return
    if name not in expected:
        mismatches.unexpected.append(source)
        return
    shape, dtype = expected[name]
    if tuple(tensor.shape) != tuple(shape):
        mismatches.add_misshaped(name, source, tensor.shape, shape)
        return
    loaded[name] = tensor.to(dtype).contiguous()


def _place_expert(name: str, stacked: str, expert: int, tensor: torch.Tensor, source: str,
                  expected: dict[str, TensorSpec], loaded: dict[str, torch.Tensor],
                  experts_seen: dict[str, set[int]], mismatches: _Mismatches) -> None:
    if stacked not in expected or expert >= expected[stacked][0][0]:
        mismatches.unexpected.append(source)
        return
    shape, dtype = expected[stacked]
    if tuple(tensor.shape) != tuple(shape[1:]):
        mismatches.add_misshaped(name, source, tensor.shape, shape[1:])
        mismatches.misshaped_names.add(stacked)
        return
    seen = experts_seen.get(stacked)
    # A stack without a `seen` set came whole (HF's fused layout), so any per-expert copy is a duplicate.
    if stacked in loaded and (seen is None or expert in seen):
        mismatches.unexpected.append(f"{source}: loaded twice")
        return
    if seen is None:
        seen = experts_seen[stacked] = set()
        loaded[stacked] = torch.empty(shape, dtype=dtype)
    loaded[stacked][expert].copy_(tensor)
    seen.add(expert)
