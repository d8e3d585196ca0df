"""Convert a bf16/fp32 DeepSeek-V4 / V4.1 checkpoint into the format DeepSeek releases: FP8 + MXFP4 + bf16/fp32.

Which tensor gets which format is data (``ReleaseRules``, one per model family), written from the released
checkpoints: FP8 e4m3 with e8m0 tile scales for the attention and shared-expert projections, MXFP4 for routed
experts, fp32 for the tensors the release keeps in fp32 (mHC, sinks, routing bias, ...), bf16 for everything else.
A quantized weight ``X.weight`` gets its scale as ``X.scale`` in the same shard, as the release stores them.

Input names must be DeepSeek's original ones (``layers.0.attn.wq_a.weight``). What HF's ``save_pretrained``
writes is accepted too: the same names under ``model.``, with three spellings of its own mapped back. HF's
in-memory module names (``self_attn.q_a_proj``, fused ``gate_up_proj``) are refused rather than guessed at.

    python -m deepinfer.loading.convert SRC DST [--max-shard-size 5GB]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from deepinfer.loading.checkpoint import INDEX_FILE, CheckpointIndex, StoredTensor
from deepinfer.runtime.quantization import quantize_fp4, quantize_fp8, weight_block_size

_LAYER = r"(?:layers|mtp)\.\d+\."
_ATTN_FFN_FP8 = rf"{_LAYER}(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight"


@dataclasses.dataclass(frozen=True)
class ReleaseRules:
    """How one family's release stores each tensor, as regexes matched against the whole DeepSeek name.

    The patterns are tried in field order. Float tensors no pattern covers are stored as bf16; integer tensors
    (V4's ``tid2eid`` routing table) are kept as they are.
    """

    block: tuple[int, int]  # FP8 tile; released configs name it in quantization_config.weight_block_size
    fp8: re.Pattern[str]  # FP8 with one scale per block tile
    mxfp4: re.Pattern[str]  # routed experts: e2m1 packed two per int8, one scale per 1 x 32
    fp8_rows: re.Pattern[str] | None  # FP8 with one scale per 1 x 32 row segment (V4.1 Engram tables)
    fp32: re.Pattern[str]

    def quantizes(self, name: str) -> bool:
        return any(p is not None and p.fullmatch(name) for p in (self.fp8, self.mxfp4, self.fp8_rows))

    def store(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The released tensor for one source tensor, plus its ``.scale`` when it is quantized."""
        tensor = tensor.detach().contiguous()
        if not tensor.is_floating_point():
            return {name: tensor}
        scale_name = name.removesuffix("weight") + "scale"
        if self.fp8.fullmatch(name):
            weight, scale = quantize_fp8(tensor, *self.block)
        elif self.mxfp4.fullmatch(name):
            weight, scale = quantize_fp4(tensor)
        elif self.fp8_rows is not None and self.fp8_rows.fullmatch(name):
            weight, scale = quantize_fp8(tensor, 1, 32)
        else:
            dtype = torch.float32 if self.fp32.fullmatch(name) else torch.bfloat16
            return {name: tensor.to(dtype)}
        return {name: weight, scale_name: scale}


# V4 (reference v4-architecture.md §6.3, §8.1): 128 x 128 tiles; MTP's e_proj/h_proj are FP8 like the attention.
V4 = ReleaseRules(
    block=(128, 128),
    fp8=re.compile(rf"{_ATTN_FFN_FP8}|mtp\.\d+\.(?:e_proj|h_proj)\.weight"),
    mxfp4=re.compile(rf"{_LAYER}ffn\.experts\.\d+\.w[123]\.weight"),
    fp8_rows=None,
    fp32=re.compile(r"(?:.*\.)?(?:hc_(?:attn|ffn|head)_(?:fn|base|scale)|attn_sink|ape|gate\.bias)"),
)
# V4.1 differs: 32 x 32 tiles, the Engram projection in FP8 and its tables with row scales, compressors in fp32,
# no MTP e_proj/h_proj (its DSpark main_proj and heads are bf16) and no hc_head. Its vision encoder is bf16 but for
# the fp32 norms.
V41 = ReleaseRules(
    block=(32, 32),
    fp8=re.compile(rf"{_ATTN_FFN_FP8}|layers\.\d+\.engram\.wkv\.weight"),
    mxfp4=V4.mxfp4,
    fp8_rows=re.compile(r"layers\.\d+\.engram\.embed\.weight"),
    fp32=re.compile(r"(?:.*\.)?(?:hc_(?:attn|ffn)_(?:fn|base|scale)|attn_sink|ffn\.gate\.bias(?:_vl)?"
                    r"|compressor\.(?:wkv|wgate)\.weight)|vision\.(?:blocks\.\d+\.norm[12]|norm)\.weight"),
)
RULES = {"deepseek_v4": V4, "deepseek_v41": V41, "deepseek_v41_text": V41}

# DeepSeek's naming: top-level tensors, decoder blocks (attention, MoE, norms, mHC, V4.1 Engram), MTP stages,
# V4.1's vision encoder.
_BLOCK = r"(?:attn|ffn|engram)\..+|(?:attn|ffn)_norm\.weight|hc_(?:attn|ffn)_(?:fn|base|scale)"
DEEPSEEK_NAME = re.compile(rf"(?:embed|head|norm)\.weight|hc_head_(?:fn|base|scale)|layers\.\d+\.(?:{_BLOCK})"
                           r"|mtp\.\d+\..+|(?:vision|aligner)\..+|image_(?:start|end|newline)")
# save_pretrained's own spellings (after its "model." prefix), mapped back to DeepSeek's.
_SAVE_PRETRAINED = [(re.compile(r"^embed_tokens\."), "embed."), (re.compile(r"^hc_head\.hc_(fn|base|scale)$"),
                     r"hc_head_\1"), (re.compile(r"\.attn\.norm\.weight$"), ".attn.kv_norm.weight")]
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}


def rules_for(config: dict) -> ReleaseRules:
    """The family's rules, with the FP8 tile from ``quantization_config.weight_block_size`` when the config has one."""
    rules = RULES.get(config.get("model_type"))
    if rules is None:
        raise ValueError(f"model_type {config.get('model_type')!r} is not one of {sorted(RULES)}")
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return dataclasses.replace(rules, block=weight_block_size(quantization, rules.block))


def original_name(name: str) -> str:
    """DeepSeek's name for a source tensor name; ValueError when it is in some other naming."""
    if name.startswith("model."):
        name = name.removeprefix("model.")
        for pattern, replacement in _SAVE_PRETRAINED:
            name = pattern.sub(replacement, name)
    if not DEEPSEEK_NAME.fullmatch(name):
        raise ValueError(name)
    return name


def _plan(src: Path, stored: dict[str, StoredTensor], rules: ReleaseRules) -> dict[str, str]:
    """Source name -> DeepSeek name for every tensor, checked from the shard headers before anything is written."""
    names, quantized, foreign = {}, [], []
    for name, tensor in stored.items():
        try:
            names[name] = original = original_name(name)
        except ValueError:
            foreign.append(name)
            continue
        if name.endswith(".scale") and name.removesuffix("scale") + "weight" in stored:
            continue  # reported with its weight
        has_scale = name.endswith(".weight") and name.removesuffix("weight") + "scale" in stored
        if tensor.dtype in _FP8 or has_scale or (rules.quantizes(original) and not tensor.dtype.is_floating_point):
            quantized.append(f"{name} ({str(tensor.dtype).removeprefix('torch.')}"
                             f"{', with a .scale' if has_scale else ''})")
    if quantized:
        raise ValueError(f"{src} is already quantized ({len(quantized)} tensors, e.g. {', '.join(quantized[:3])}); "
                         "this converter takes a bf16/fp32 checkpoint")
    if foreign:
        raise ValueError(f"{src} is not in DeepSeek's original tensor naming ({len(foreign)} tensors, e.g. "
                         f"{', '.join(foreign[:3])}); expected names such as 'layers.0.attn.wq_a.weight', "
                         "'layers.0.ffn.experts.0.w1.weight', 'embed.weight' (also accepted under HF save_pretrained's "
                         "'model.' prefix); HF's in-memory module names (self_attn, mlp, gate_up_proj) are not")
    return names


class ShardWriter:
    """Packs tensor groups (a weight and its scale) into shards of at most ``max_bytes`` of tensor data.

    Shards are written under temporary names as they fill, since the final names carry the shard count.
    A group bigger than ``max_bytes`` gets a shard of its own.
    """

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_size = 0

    def add(self, group: dict[str, torch.Tensor]) -> None:
        size = sum(t.nbytes for t in group.values())
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending.update(group)
        self.pending_bytes += size
        self.total_size += size

    def _flush(self) -> None:
        path = self.directory / f".partial-{len(self.written) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name the shards ``model-0000i-of-0000N.safetensors`` and write the index."""
        if self.pending:
            self._flush()
        weight_map = {}
        for i, (path, names) in enumerate(self.written, 1):
            final = f"model-{i:05d}-of-{len(self.written):05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def convert_checkpoint(src_dir: str | os.PathLike[str], dst_dir: str | os.PathLike[str], *,
                       max_shard_bytes: int = 5 * 2**30, progress: bool = True) -> Path:
    """Write ``src_dir``'s float checkpoint into the empty (or new) ``dst_dir`` in the released format; return it.

    The source is read one tensor at a time; at most one output shard is held in memory. ``max_shard_bytes`` caps
    each shard's tensor data (headers excluded, as the index's ``total_size`` counts). Every tensor is checked
    (naming, not already quantized) from the headers before anything is written; a later failure leaves the partial
    output in ``dst_dir``. ``config.json`` gets the released ``quantization_config`` at its top level; every other
    non-safetensors file and folder is copied.
    """
    src, dst = Path(src_dir).resolve(), Path(dst_dir).resolve()
    if dst.is_relative_to(src):
        raise ValueError(f"the destination {dst} is inside the source checkpoint {src}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"the destination {dst} is not empty")
    config = json.loads((src / "config.json").read_text())
    rules = rules_for(config)
    index = CheckpointIndex.from_dir(src)
    stored = index.headers()
    names = _plan(src, stored, rules)
    dst.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(dst, max_shard_bytes)
    total = sum(t.nbytes for t in stored.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="Quantizing", disable=not progress) as bar:
        for source, tensor in index.read(list(stored.values())):
            try:
                writer.add(rules.store(names[source.name], tensor))
            except ValueError as err:  # a shape the format cannot hold, e.g. MXFP4 columns not a multiple of 32
                raise ValueError(f"cannot quantize {source.name} {tuple(tensor.shape)}: {err}") from err
            bar.update(tensor.nbytes)
    writer.finish()
    config["quantization_config"] = {**QUANTIZATION_CONFIG, "weight_block_size": list(rules.block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for entry in src.iterdir():
        # Hidden entries are caches (.cache/huggingface, .git) that describe the source files, not model files.
        if entry.name.startswith(".") or entry.name in ("config.json", INDEX_FILE) or entry.suffix == ".safetensors":
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name, ignore=shutil.ignore_patterns("*.safetensors"))
        else:
            shutil.copy2(entry, dst / entry.name)
    return dst


def byte_size(text: str) -> int:
    """``500MB``, ``5GB``, ``5GiB`` or plain bytes; units are powers of 1024, matching the 5 * 2**30 default."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    return int(float(match.group(1)) * 1024 ** (" kmgt".index(match.group(2).lower()) if match.group(2) else 0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.loading.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoint directory with bf16/fp32 safetensors in DeepSeek's naming")
    parser.add_argument("dst", help="new or empty output directory")
    parser.add_argument("--max-shard-size", type=byte_size, default="5GB",
                        help="largest output shard, e.g. 500MB, 5GB or bytes (default 5GB = 5 * 2**30)")
    args = parser.parse_args(argv)
    try:
        print(convert_checkpoint(args.src, args.dst, max_shard_bytes=args.max_shard_size))
    except (ValueError, FileExistsError, FileNotFoundError) as err:  # the input's problem, not a bug: no traceback
        parser.error(str(err))


if __name__ == "__main__":
    main()
