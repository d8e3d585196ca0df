"""Loading a checkpoint into a model's tensors: planned from the shard headers, then streamed shard by shard.

``plan_load`` reads only the headers. It maps every checkpoint name onto the model's canonical names, decides how
each weight is held (as stored, or dequantized once when it is read), and checks shapes, dtypes and scale shapes
against the model and its block size. Every problem is reported at once, naming the tensor and its file, before any
tensor data is read. ``stream_into`` then reads one tensor at a time and copies it into the model's preallocated
tensors on the target device, so host memory stays near one shard (safetensors maps the shard being read).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from deepinfer.loading.checkpoint import CheckpointIndex, StoredTensor, mapped_tensor
from deepinfer.models.contract import CheckpointNaming
from deepinfer.runtime.quantization import MX_BLOCK, dequantize, infer_block, logical_shape, scale_shape

logger = logging.getLogger(__name__)

TensorSpec = tuple[tuple[int, ...], torch.dtype]
_QUANTIZED = (torch.float8_e4m3fn, torch.int8)
# A real mismatch can involve thousands of tensors; the first few of each kind say what went wrong.
_MAX_LISTED = 20


@dataclass(slots=True)
class _Problems:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    inconsistent: list[str] = field(default_factory=list)
    # Present but wrong, so not also "missing".
    seen: set[str] = field(default_factory=set)

    def bad(self, name: str, message: str) -> None:
        self.inconsistent.append(message)
        self.seen.add(name)

    def raise_if_any(self, model_dir: Path) -> None:
        if not (self.missing or self.unexpected or self.inconsistent):
            return
        lines = [f"Checkpoint in {model_dir} does not match the model:"]
        for title, entries in (("missing", self.missing), ("unexpected", self.unexpected),
                               ("mis-shaped or inconsistent", self.inconsistent)):
            if entries:
                lines.append(f"  {title} tensors ({len(entries)}):")
                lines += [f"    {entry}" for entry in entries[:_MAX_LISTED]]
                if len(entries) > _MAX_LISTED:
                    lines.append(f"    ... and {len(entries) - _MAX_LISTED} more")
        raise ValueError("\n".join(lines))


@dataclass(slots=True)
class _Part:
    """One canonical tensor (or one expert of a stacked one) inside a checkpoint tensor."""

    name: str  # canonical name; for an expert, the stacked name
    expert: int | None
    shape: tuple[int, ...]
    stored: StoredTensor

    def where(self) -> str:
        own = self.name if self.expert is None else _expert_name(self.name, self.expert)
        if own == self.stored.name:
            return f"{own} (in {self.stored.file})"
        return f"{own} (from {self.stored.name} in {self.stored.file})"


def _expert_name(stacked: str, expert: int) -> str:
    prefix, leaf = stacked.rsplit(".experts.", 1)
    return f"{prefix}.experts.{expert}.{leaf}"


@dataclass(slots=True)
class LoadPlan:
    index: CheckpointIndex
    stored: dict[str, StoredTensor]  # every tensor of every shard, from the headers
    layout: dict[str, TensorSpec]  # what the model allocates, by canonical name
    copied: list[StoredTensor]  # copied into the model's tensors (read in file order)
    dequantized: set[str]  # checkpoint names of weights/scales dequantized when read
    mapped: list[StoredTensor]  # returned as views of the file
    naming: CheckpointNaming
    held_experts: Mapping[str, Sequence[int]] = field(default_factory=dict)

    def local_slots(self, stacked: str, expert: int) -> list[int]:
        return _local_slots(self.held_experts, stacked, expert)


def _local_slots(held_experts: Mapping[str, Sequence[int]], stacked: str, expert: int) -> list[int]:
    """Where checkpoint expert ``expert`` of ``stacked`` goes in this process's stack: its own index, or under
    expert parallelism every local slot that holds it (none: another rank's expert)."""
    held = held_experts.get(stacked)
    return [expert] if held is None else [slot for slot, e in enumerate(held) if e == expert]


def plan_load(
    model_dir: str | os.PathLike[str],
    expected: dict[str, TensorSpec],
    *,
    naming: CheckpointNaming,
    quantizable: set[str] = frozenset(),
    block: tuple[int, int] = (128, 128),
    memory_mapped: Callable[[str], bool] | None = None,
    held_experts: Mapping[str, Sequence[int]] | None = None,
) -> LoadPlan:
    """Check the checkpoint against ``expected`` (canonical name -> float shape and dtype) from its headers.

    Weights named in ``quantizable`` stay as stored when the checkpoint ships them quantized; their FP8 scales must
    tile them in ``block``. Other quantized weights are dequantized to the expected dtype when read. Per-expert
    tensors (``ffn.experts.{e}.w1.weight``) fill the expected stacked [E, ...] tensor. Under expert parallelism
    ``held_experts`` maps a stacked name to the checkpoint expert of each of its local slots: only those are read.
    """
    model_dir = Path(model_dir)
    index = CheckpointIndex.from_dir(model_dir)
    problems = _Problems()
    parts: dict[str, list[_Part]] = {}  # canonical (stacked) name -> its parts
    mapped, skipped = [], 0
    headers = index.headers()
    for stored in headers.values():
        if memory_mapped is not None and memory_mapped(stored.name):
            _check_exact(stored, expected, problems)
            mapped.append(stored)
            continue
        name = naming.canonical(stored.name)
        if name is None:
            skipped += 1
            continue
        for part_name, part in naming.split(name, torch.empty(stored.shape, device="meta")):
            slot = naming.expert_slot(part_name)
            if slot is None:
                parts.setdefault(part_name, []).append(_Part(part_name, None, tuple(part.shape), stored))
            for local in [] if slot is None else _local_slots(held_experts or {}, *slot):
                parts.setdefault(slot[0], []).append(_Part(slot[0], local, tuple(part.shape), stored))
    if skipped:
        logger.debug("Skipping %d tensors in %s that this model does not use", skipped, model_dir)

    layout: dict[str, TensorSpec] = {}
    dequantized: set[str] = set()
    for name, name_parts in parts.items():
        base, _, leaf = name.rpartition(".")
        if leaf == "scale":
            if f"{base}.weight" not in parts:
                problems.unexpected += [f"{p.where()}: a scale without its weight {base}.weight" for p in name_parts]
            continue
        if name not in expected:
            problems.unexpected += [p.where() for p in name_parts]
            continue
        _plan_tensor(name, name_parts, parts.get(f"{base}.scale") if leaf == "weight" else None, expected[name],
                     name in quantizable, block, layout, dequantized, problems)
    mapped_names = {t.name for t in mapped}
    problems.missing += [n for n in expected if n not in layout and n not in problems.seen and n not in mapped_names]
    problems.raise_if_any(model_dir)
    copied = list({p.stored.name: p.stored for ps in parts.values() for p in ps}.values())
    return LoadPlan(index, headers, layout, copied, dequantized, mapped, naming, held_experts or {})


def _check_exact(stored: StoredTensor, expected: dict[str, TensorSpec], problems: _Problems) -> None:
    spec = expected.get(stored.name)
    if spec is None:
        problems.unexpected.append(f"{stored.name} (in {stored.file})")
    elif (stored.shape, stored.dtype) != (tuple(spec[0]), spec[1]):
        problems.bad(stored.name, f"{stored.name} (in {stored.file}): got {stored.shape} {stored.dtype}, "
                                  f"expected {tuple(spec[0])} {spec[1]}")


def _plan_tensor(name: str, parts: list[_Part], scales: list[_Part] | None, spec: TensorSpec, quantizable: bool,
                 block: tuple[int, int], layout: dict[str, TensorSpec], dequantized: set[str],
                 problems: _Problems) -> None:
    shape, dtype = tuple(spec[0]), spec[1]
    stacked = parts[0].expert is not None
    per_part = shape[1:] if stacked else shape
    if not _complete(name, parts, shape[0] if stacked else None, problems):
        return
    first = parts[0]
    quantized = first.stored.dtype in _QUANTIZED
    for part in parts:
        if part.stored.dtype != first.stored.dtype:
            return problems.bad(name, f"{part.where()}: stored as {part.stored.dtype} but "
                                      f"{first.where()} as {first.stored.dtype}")
        got = logical_shape(part.shape, part.stored.dtype) if quantized else part.shape
        if got != per_part:
            return problems.bad(name, f"{part.where()}: got {part.shape}, expected {per_part}"
                                      + (" (packed MXFP4)" if part.stored.dtype == torch.int8 else ""))
    if not quantized:
        if scales:
            problems.unexpected += [f"{s.where()}: a scale for a {first.stored.dtype} weight" for s in scales]
        layout[name] = (shape, dtype)
        return
    if not scales:
        return problems.bad(name, f"{first.where()}: a {first.stored.dtype} weight needs its scale "
                                  f"{name.removesuffix('weight')}scale, which the checkpoint does not have")
    scale_name = scales[0].name
    if not _complete(scale_name, scales, shape[0] if stacked else None, problems):
        return
    for part, scale in zip(sorted(parts, key=_order), sorted(scales, key=_order)):
        problem = _scale_problem(part, scale, block if quantizable else None)
        if problem:
            return problems.bad(name, f"{scale.where()}: {problem}")
    if quantizable:
        lead = shape[:1] if stacked else ()
        layout[name] = ((*lead, *first.shape), first.stored.dtype)
        layout[scale_name] = ((*lead, *scales[0].shape), scales[0].stored.dtype)
    else:
        layout[name] = (shape, dtype)
        dequantized.update(p.stored.name for p in (*parts, *scales))


def _scale_problem(weight: _Part, scale: _Part, block: tuple[int, int] | None) -> str | None:
    """Why ``scale`` cannot scale ``weight``: MXFP4 needs one scale per 1x32, FP8 one per tile of ``block`` (kept
    weights, which the GEMM kernels multiply as is) or of any power-of-two size (dequantized when read)."""
    rows, cols = weight.shape[-2:]
    if weight.stored.dtype == torch.int8:
        needed = scale_shape(weight.shape, torch.int8, (1, MX_BLOCK))
        return None if scale.shape == needed else f"shape {scale.shape}; MXFP4 {weight.shape} weights need {needed}"
    if block is not None:
        needed = scale_shape(weight.shape, weight.stored.dtype, block)
        if scale.shape != needed:
            return (f"shape {scale.shape} does not fit {block[0]}x{block[1]} blocks of its {weight.shape} weight, "
                    f"which need {needed} (quantization_config.weight_block_size is {list(block)})")
        return None
    try:
        infer_block(rows, scale.shape[-2]), infer_block(cols, scale.shape[-1])
    except ValueError as error:
        return f"shape {scale.shape} cannot scale its {weight.shape} weight: {error}"
    return None


def _order(part: _Part) -> int:
    return -1 if part.expert is None else part.expert


def _complete(name: str, parts: list[_Part], experts: int | None, problems: _Problems) -> bool:
    """Exactly one part per expert (or one whole tensor); reports the gaps and duplicates."""
    if experts is None:
        if len(parts) > 1 or parts[0].expert is not None:
            problems.unexpected += [f"{p.where()}: loaded twice" for p in parts[1:]]
        return len(parts) == 1 and parts[0].expert is None
    seen: dict[int, _Part] = {}
    for part in parts:
        if part.expert is None or part.expert >= experts:
            problems.unexpected.append(part.where())
        elif part.expert in seen:
            problems.unexpected.append(f"{part.where()}: loaded twice")
        else:
            seen[part.expert] = part
    absent = [_expert_name(name, e) for e in range(experts) if e not in seen]
    problems.missing += absent
    if absent:
        problems.seen.add(name)
    return not absent and len(seen) == len(parts)


def stream_into(plan: LoadPlan, targets: dict[str, torch.Tensor], progress: bool = True) -> dict[str, torch.Tensor]:
    """Copy every planned tensor into ``targets`` (allocated per ``plan.layout``), one tensor at a time.

    Returns the memory-mapped tensors by checkpoint name.
    """
    extras = {t.name: mapped_tensor(plan.index.directory / t.file, t.name) for t in plan.mapped}
    reads = plan.copied
    bar = tqdm(total=sum(t.nbytes for t in reads), unit="B", unit_scale=True, desc="Loading weights",
               disable=not progress)
    halves: dict[str, torch.Tensor] = {}  # the first-read half of a weight that is dequantized when read
    done = 0
    with bar:
        for stored, tensor in plan.index.read(reads):
            _place(plan, stored.name, tensor, targets, halves)
            done += 1
            bar.update(stored.nbytes)
            bar.set_postfix_str(f"{done}/{len(reads)} tensors", refresh=False)
    return extras


def _place(plan: LoadPlan, checkpoint_name: str, tensor: torch.Tensor, targets: dict[str, torch.Tensor],
           halves: dict[str, torch.Tensor]) -> None:
    naming = plan.naming
    for name, part in naming.split(naming.canonical(checkpoint_name), tensor):
        slot = naming.expert_slot(name)
        if checkpoint_name in plan.dequantized:
            base, _, leaf = name.rpartition(".")
            partner = halves.pop(f"{base}.{'scale' if leaf == 'weight' else 'weight'}", None)
            if partner is None:
                halves[name] = part
                continue
            weight, scale = (part, partner) if leaf == "weight" else (partner, part)
            name, slot = f"{base}.weight", naming.expert_slot(f"{base}.weight")
            part = dequantize(weight, scale, targets[name if slot is None else slot[0]].dtype)
        if slot is None:
            targets[name].copy_(part)
        for local in [] if slot is None else plan.local_slots(*slot):
            targets[slot[0]][local].copy_(part)


def load_state_dict(model_dir: str | os.PathLike[str], expected: dict[str, TensorSpec], **plan_options
                    ) -> dict[str, torch.Tensor]:
    """The whole checkpoint as a CPU state dict under canonical names (for tools and tests; the engine streams
    into the model instead). Quantized weights come dequantized unless named in ``quantizable``."""
    plan = plan_load(model_dir, expected, **plan_options)
    targets = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in plan.layout.items()}
    return {**targets, **stream_into(plan, targets, progress=False)}


def dummy_layout(expected: dict[str, TensorSpec], quantizable: set[str], block: tuple[int, int],
                 fp8_experts: bool = False) -> dict[str, TensorSpec]:
    """The released formats without a checkpoint: quantizable projections FP8 in ``block`` tiles, routed experts
    packed MXFP4 (FP8 like the rest with ``fp8_experts``: V4-Flash-Base), everything else as ``expected``."""
    layout = {}
    for name, (shape, dtype) in expected.items():
        shape = tuple(shape)
        if name not in quantizable:
            layout[name] = (shape, dtype)
            continue
        stored_dtype = torch.int8 if ".experts." in name and not fp8_experts else torch.float8_e4m3fn
        stored = (*shape[:-1], shape[-1] // 2) if stored_dtype == torch.int8 else shape
        layout[name] = (stored, stored_dtype)
        layout[f"{name.removesuffix('weight')}scale"] = (scale_shape(stored, stored_dtype, block), torch.float8_e8m0fnu)
    return layout


def fill_dummy(tensors: dict[str, torch.Tensor], seed: int, num_experts: int) -> None:
    """Random values that keep activations in range: projections with std ~ fan_in^-1/2, norms 1, other vectors 0,
    hash-routing tables spread over the experts."""
    for index, (name, tensor) in enumerate(sorted(tensors.items())):
        g = torch.Generator(device=tensor.device).manual_seed(seed + index)

        def normal(std: float) -> torch.Tensor:
            return torch.randn(tensor.shape, generator=g, device=tensor.device) * std

        if tensor.dtype == torch.float8_e8m0fnu:
            weight = tensors[f"{name.removesuffix('scale')}weight"]
            fan_in = logical_shape(tuple(weight.shape), weight.dtype)[-1]
            code_std = 2.9 if weight.dtype == torch.int8 else 0.5  # of random e2m1 codes / of normal(0.5) in e4m3
            tensor.copy_(torch.full(tensor.shape, 2.0 ** round(math.log2(fan_in**-0.5 / code_std)),
                                    device=tensor.device).to(tensor.dtype))
        elif tensor.dtype == torch.int8:
            tensor.copy_(torch.randint(-128, 128, tensor.shape, generator=g, device=tensor.device, dtype=torch.int8))
        elif tensor.dtype == torch.float8_e4m3fn:
            tensor.copy_(normal(0.5).to(tensor.dtype))
        elif name.endswith("tid2eid"):
            tensor.copy_(torch.randint(0, num_experts, tensor.shape, generator=g, device=tensor.device))
        elif not tensor.is_floating_point():
            tensor.zero_()
        elif tensor.dim() < 2:
            tensor.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        else:
            tensor.copy_(normal(tensor.shape[-1] ** -0.5))
