"""A safetensors checkpoint on disk: its shards, their headers, and one-tensor-at-a-time reads."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(slots=True, frozen=True)
class StoredTensor:
    """One tensor as a shard's header describes it."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # of the first data byte in the file
    nbytes: int


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

    def headers(self) -> dict[str, StoredTensor]:
        """Every tensor of every shard, from the headers alone (no tensor data is read).

        A shard shorter than its header says (an interrupted download) or with a corrupt header is an error
        naming the file, raised before anything is loaded.
        """
        stored: dict[str, StoredTensor] = {}
        for file in self.files:
            for tensor in _read_header(self.directory / file):
                if tensor.name in stored:
                    raise ValueError(f"tensor {tensor.name} is stored twice: in {stored[tensor.name].file} and {file}")
                stored[tensor.name] = tensor
        return stored

    def read(self, tensors: list[StoredTensor]) -> Iterator[tuple[StoredTensor, torch.Tensor]]:
        """Each tensor in a fresh CPU buffer, one at a time, shard by shard in file order, with plain reads.

        Not through a memory map (as safetensors' ``get_tensor`` does): mapped pages count as the process's memory
        until the shard is closed, so host memory would grow to a whole shard instead of one tensor.
        """
        handles: dict[str, object] = {}
        shard_order = {file: i for i, file in enumerate(self.files)}
        try:
            for tensor in sorted(tensors, key=lambda t: (shard_order[t.file], t.offset)):
                f = handles.get(tensor.file) or handles.setdefault(tensor.file, open(self.directory / tensor.file, "rb"))
                buffer = torch.empty(tensor.nbytes, dtype=torch.uint8)
                f.seek(tensor.offset)
                if f.readinto(buffer.numpy()) != tensor.nbytes:
                    raise ValueError(f"{tensor.file} ended while reading {tensor.name}")
                yield tensor, buffer.view(tensor.dtype).view(tensor.shape)
        finally:
            for f in handles.values():
                f.close()


def _read_header(path: Path) -> list[StoredTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
        if 8 + header_len > size:
            raise ValueError(f"{path} is truncated or not a safetensors file: its header needs {header_len} bytes, "
                             f"the file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} has a corrupt safetensors header: {err}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    tensors, data_end = [], 0
    for name, entry in header.items():
        if not _well_formed(entry):
            raise ValueError(f"{path} has a corrupt safetensors header: entry {name!r} is {entry!r}")
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{name} (in {path.name}) has dtype {entry.get('dtype')!r}, which DeepInfer cannot load")
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(entry["shape"]) * dtype.itemsize:
            raise ValueError(f"{path} has a corrupt safetensors header: {name} has shape {entry['shape']} of "
                             f"{entry['dtype']} but {end - begin} bytes")
        data_end = max(data_end, end)
        tensors.append(StoredTensor(name, path.name, tuple(entry["shape"]), dtype, 8 + header_len + begin, end - begin))
    if 8 + header_len + data_end > size:
        raise ValueError(f"{path} is truncated: its header describes {data_end} bytes of tensor data but the file "
                         f"holds {size - 8 - header_len} (an interrupted download? fetch the shard again)")
    return tensors


def _well_formed(entry: object) -> bool:
    """A tensor entry as the format defines it: a shape of sizes and two ordered byte offsets."""
    if not isinstance(entry, dict):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1])


def mapped_tensor(path: Path, name: str) -> torch.Tensor:
    """A tensor backed by the file's pages (read-only mapping): nothing is read until it is indexed."""
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(header_len))[name]
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    begin, end = entry["data_offsets"]
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    with warnings.catch_warnings():  # read-only on purpose: the checkpoint must never be written through
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(memoryview(mapping), dtype=torch.uint8, count=end - begin, offset=8 + header_len + begin)
    return raw.view(dtype).view(entry["shape"])
