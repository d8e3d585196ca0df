"""Distil the embedded model's DSpark draft on the target's own continuations (draft only, target frozen).

``tools/training/train_tiny_v41.py`` trained the draft on corpus text, but greedy verification accepts a draft token only
when it is the target's argmax; so, as EAGLE and DFlash do, the released draft is fine-tuned here on what the target
generates. Prompts are random windows of the training split (the held-out hash rule of the checkpoint's
``training.json``); continuations are the target's greedy outputs, recomputed without a KV cache in chunks of
``--gen-batch``. A ``--sampled-share`` of the chunks is sampled at ``--temperature`` 0.8: a small model's greedy
chains fall into a few loops and sampled ones show the draft the states around them; greedy stays the majority, as
greedy verification sees greedy chains. NeMo's DSpark loss (``dspark_step_loss``) trains anchors from the last prompt
token to the continuation's first EOS (where the engine stops). Acceptance is measured before and after as
``training.json``'s ``dspark_greedy_acceptance`` (``dspark_acceptance`` on ``ACCEPTANCE_PROTOCOL``'s held-out
prompts, fp32, per-expert loop, no TF32): "after" for the exported FP8/MXFP4 draft, "after_before_export" in fp32.

CPU smoke run (the NeMo venv of ``tools/goldens/v41_golden.py``, plus pluggy; about 2 minutes on 2 cores):

    PYTHONPATH=. /work/nemo-venv/bin/python tools/training/distill_tiny_draft.py --out /tmp/tiny-v41-distilled \\
        --device cpu --minutes 1.5 --max-corpus-mb 1 --prompt-len 32 --new-tokens 32

GPU (one H200: Python 3.12, torch 2.11+cu130, transformers 5.17, no network; the wheels that train_tiny_v41.py's
docstring fetches into the git-ignored ``.wheels/``), from the repository root, about 6.5 minutes in all:

    pip install --no-deps --no-index --target /tmp/site .wheels/*.whl
    PYTHONPATH=.:/tmp/site python tools/training/distill_tiny_draft.py --out /tmp/tiny-v41-distilled --device cuda --seed 0

Generation and training take turns: the set grows by a chunk whenever every sequence has been seen ``--epochs``
times (until ``--gen-until`` of the time), so a slow or fast GPU changes how much is seen, not how often.
``--minutes`` bounds the run after the imports, ``--reserve`` of it kept for measuring and export (learning rate by
elapsed time); ``--sequences N --steps M`` replays a run by count (``distillation.json`` records both).
Output: the input's config, tokenizer files and ``training.json`` (the target's record); ``model.safetensors`` with
the non-``mtp.*`` tensors byte-identical to the input's (checked) and the trained ``mtp.*`` in the released formats;
``distillation.json`` (command, seed, versions, set, steps, seconds, tokens, losses, acceptance before and after).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo's compiled activations run eager, as in train_tiny_v41

import argparse
import hashlib
import json
import platform
import shlex
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast

import nemo_automodel
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from tools.training.tiny_v41_corpus import build_corpus, encode_documents, split_documents
from tools.training.tiny_v41_metrics import ACCEPTANCE_PROTOCOL, acceptance_prompts, dspark_acceptance
from tools.training.tiny_v41_model import FeatureCapture, build_models, load_released, released_draft_tensors
from tools.training.train_tiny_v41 import dspark_step_loss, lr_factor, parameter_groups, update_gate_biases

CHECKPOINT = Path(__file__).resolve().parents[2] / "deepinfer" / "assets" / "tiny_v41"
COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "training.json")


def load_checkpoint(ckpt: Path, device, grouped_experts: bool, num_anchors: int):
    """NeMo's target and DSpark draft in fp32, loaded from the released tensors through NeMo's adapters."""
    raw = json.loads((ckpt / "config.json").read_text())
    raw["dtype"] = raw["text_config"]["dtype"] = "float32"
    config = DeepseekV41Config(**raw)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(ckpt))
    tensors = load_file(str(ckpt / "model.safetensors"))
    model, draft = build_models(config, tokenizer, device, num_anchors, grouped_experts=grouped_experts)
    load_released(model, draft, tensors, device)
    model.eval().requires_grad_(False)
    return config, tokenizer, tensors, model, draft


def corpus_streams(ckpt: Path, tokenizer, max_corpus_mb: float | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Train and held-out token streams under the split the checkpoint was trained with."""
    record = ckpt / "training.json"
    trained = json.loads(record.read_text())["corpus"] if record.exists() else {}
    heldout, tests = trained.get("heldout_fraction", 0.03), trained.get("include_tests", True)
    docs = build_corpus(tests, None if max_corpus_mb is None else int(max_corpus_mb * 1e6))
    train_docs, heldout_docs = split_documents(docs, heldout)
    train, held = encode_documents(tokenizer, train_docs), encode_documents(tokenizer, heldout_docs)
    info = {"documents": len(docs), "train_documents": len(train_docs), "heldout_documents": len(heldout_docs),
            "train_tokens": train.numel(), "heldout_tokens": held.numel(), "heldout_fraction": heldout,
            "include_tests": tests, "max_corpus_mb": max_corpus_mb}
    return train, held, info


@torch.no_grad()
def continue_prompts(model, ids, new_tokens: int, temperature: float, generator, autocast) -> torch.Tensor:
    """The target's continuation, the whole sequence recomputed per token (NeMo's model has no KV cache)."""
    for _ in range(new_tokens):
        with autocast:
            hidden = model(ids, logits_to_keep=1, return_hidden_states=True).hidden_states[:, -1]
        logits = hidden.float() @ model.lm_head.weight.float().T  # fp32 head: bf16 logits tie near-equal tokens
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def continuation_mask(seqs: torch.Tensor, prompt_len: int, eos: int) -> torch.Tensor:
    """Anchors from the last prompt token through the continuation's first EOS, nothing after it."""
    mask = torch.zeros_like(seqs)
    mask[:, prompt_len - 1:] = 1
    eos_seen = (seqs[:, prompt_len:] == eos).int().cumsum(1)
    mask[:, prompt_len + 1:] *= (eos_seen[:, :-1] == 0).to(mask.dtype)  # keep the EOS itself as a target
    return mask


class DistillationSet:
    """The target's continuations of random training-split windows, grown a chunk of ``--gen-batch`` at a time;
    chunks spread evenly at ``--sampled-share`` are sampled, the rest greedy."""

    def __init__(self, model, stream: torch.Tensor, args, eos: int, autocast, log):
        self.model, self.stream, self.args, self.eos, self.autocast, self.log = model, stream, args, eos, autocast, log
        self.windows = torch.Generator().manual_seed(args.seed + 1)
        self.sampling = torch.Generator(device=stream.device).manual_seed(args.seed + 2)
        self.seqs = self.masks = None
        self.chunks, self.sampled, self.seconds, self.last_seconds = 0, 0, 0.0, 0.0

    def __len__(self) -> int:
        return 0 if self.seqs is None else len(self.seqs)

    def grow(self) -> None:
        args, t = self.args, time.time()
        size = args.gen_batch if args.sequences is None else min(args.gen_batch, args.sequences - len(self))
        is_sampled = int((self.chunks + 1) * args.sampled_share) > int(self.chunks * args.sampled_share)
        starts = torch.randint(0, self.stream.numel() - args.prompt_len, (size,), generator=self.windows)
        prompts = self.stream[(starts.unsqueeze(1) + torch.arange(args.prompt_len)).to(self.stream.device)].long()
        seqs = continue_prompts(self.model, prompts, args.new_tokens, args.temperature if is_sampled else 0.0,
                                self.sampling, self.autocast)
        masks = continuation_mask(seqs, args.prompt_len, self.eos)
        self.seqs = seqs if self.seqs is None else torch.cat([self.seqs, seqs])
        self.masks = masks if self.masks is None else torch.cat([self.masks, masks])
        self.chunks, self.sampled = self.chunks + 1, self.sampled + size * is_sampled
        self.last_seconds = time.time() - t
        self.seconds += self.last_seconds
        self.log(f"set: chunk {self.chunks} ({'sampled' if is_sampled else 'greedy'}), {len(self)} sequences, "
                 f"{time.time() - t:.1f}s")

    def summary(self) -> dict:
        args, n = self.args, len(self)
        per_sequence = args.new_tokens * (args.prompt_len + (args.new_tokens - 1) / 2)  # tokens the recompute runs
        return {"sequences": n, "greedy_sequences": n - self.sampled, "sampled_sequences": self.sampled,
                "chunk": args.gen_batch, "sampled_share": args.sampled_share, "temperature": args.temperature,
                "prompt_tokens": args.prompt_len, "continuation_tokens": args.new_tokens,
                "anchor_positions": int((self.masks[:, :-1] * self.masks[:, 1:]).sum()) if n else 0,
                "seconds": round(self.seconds, 1),
                "forward_tokens_per_second": round(n * per_sequence / max(self.seconds, 1e-9))}


def distill(model, draft, capture, data: DistillationSet, args, batch: int, autocast, deadline: float, log) -> dict:
    """Grow the set and train the draft in turns: a new chunk whenever the set has been seen ``--epochs`` times (a
    few hundred sequences seen more often over-fit: the draft learns them, not the target), a step otherwise, until
    ``--gen-until`` of the time. NeMo's DSpark objective; the target runs forward only (features, final hidden)."""
    fused = {"fused": True} if data.stream.is_cuda else {}
    opt = torch.optim.AdamW(parameter_groups(draft, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), **fused)
    picks = torch.Generator().manual_seed(args.seed + 3)
    history, step, passes, t0 = [], 0, 0, time.time()
    seconds = max(deadline - t0, 1.0)

    def progress() -> float:
        if args.steps is not None:
            return step / args.steps if args.steps else 1.0
        return (time.time() - t0) / seconds

    def wants_data(p: float) -> bool:  # decided by counts alone once --sequences is given, so a replay matches
        seen = len(data) == 0 or passes >= args.epochs * len(data)
        if args.sequences is not None:
            return seen and len(data) < args.sequences
        return len(data) == 0 or seen and p + data.last_seconds / seconds < args.gen_until  # ends before gen_until

    def record(values: dict) -> None:
        history.append({"step": step, "t": round(time.time() - t0, 1), "sequences": len(data),
                        "lr": round(opt.param_groups[0]["lr"], 6),
                        **{k: round(v.detach().item(), 5) for k, v in values.items()}})
        log(" ".join(f"{k}={v}" for k, v in history[-1].items()))

    draft.train()
    while (p := progress()) < 1 or len(data) == 0:
        if wants_data(p):
            data.grow()
            continue
        idx = torch.randint(0, len(data), (batch,), generator=picks).to(data.seqs.device)
        inputs, mask = data.seqs[idx], data.masks[idx]
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(p, args.warmup)
        with torch.no_grad(), autocast:
            final_hidden = model(inputs, logits_to_keep=1, return_hidden_states=True).hidden_states  # all positions
        with autocast:
            loss, terms = dspark_step_loss(draft, inputs, capture.features(), final_hidden, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_gate_biases(draft)
        step, passes = step + 1, passes + batch
        # tau: the expected accepted length as NeMo trains it (probability distance, not greedy)
        values = {"loss": loss, "ce": terms["ce_loss"], "tau": terms["tau_num"] / terms["tau_den"].clamp_min(1)}
        if step == 1 or step % args.log_every == 0:
            record(values)
    if step and history[-1]["step"] != step:
        record(values)
    return {"steps": step, "seconds": round(time.time() - t0, 1), "batch_size": batch, "sequence_passes": passes,
            "tokens": passes * data.seqs.shape[1], "epochs": round(passes / len(data), 2), "history": history}


def safetensors_entries(path: Path) -> dict[str, tuple]:
    """name -> (dtype, shape, stored bytes), read from the file itself."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + size]), raw[8 + size:]
    return {k: (v["dtype"], v["shape"], data[slice(*v["data_offsets"])]) for k, v in header.items()
            if k != "__metadata__"}


def verify_main_model_unchanged(src: Path, dst: Path) -> str:
    """Every non-mtp tensor stored byte for byte as in the input, every mtp one with the input's dtype and shape.
    Returns the sha256 of the main model's tensor bytes."""
    a, b = safetensors_entries(src), safetensors_entries(dst)
    main = sorted(k for k in a if not k.startswith("mtp."))
    differ = [k for k in a.keys() | b.keys() if k not in a or k not in b or a[k][:2] != b[k][:2]]
    differ += [k for k in main if k in b and a[k][2] != b[k][2]]
    if differ:
        raise RuntimeError(f"main-model tensors changed, or tensor names, dtypes or shapes differ: {sorted(differ)}")
    return hashlib.sha256(b"".join(a[k][2] for k in main)).hexdigest()


def write_checkpoint(ckpt: Path, out: Path, tensors: dict, draft) -> dict[str, torch.Tensor]:
    """The input's main-model tensors as loaded from its file, the trained draft's ``mtp.*`` in released format."""
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (ckpt / name).exists():
            shutil.copyfile(ckpt / name, out / name)
    merged = {k: v for k, v in tensors.items() if not k.startswith("mtp.")} | released_draft_tensors(draft)
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})  # as train_tiny_v41 exports
    return merged


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT, help="input checkpoint directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget after the imports")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequences", type=int, help="distillation sequences (replaces --gen-until)")
    parser.add_argument("--steps", type=int, help="training steps (replaces the training time box)")
    # Data, not steps, is what is short: on a few hundred sequences the draft learns them, not the target (on CPU:
    # greedy acceptance on its training sequences 1.66 -> 1.93, on unseen ones 1.53 -> 1.54). Hence a cap on passes
    # per sequence and a peak learning rate at the released draft's final one.
    parser.add_argument("--epochs", type=float, default=3.0, help="passes over the set before it grows")
    parser.add_argument("--gen-until", type=float, default=0.85, help="time share after which the set stops growing")
    parser.add_argument("--gen-batch", type=int, help="sequences per chunk (default: 512 cuda, 8 cpu)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (one sliding window)")
    parser.add_argument("--new-tokens", type=int, default=96, help="continuation tokens per prompt")
    parser.add_argument("--sampled-share", type=float, default=0.25, help="share of chunks sampled, not greedy")
    parser.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled chunks")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: 128 cuda, 4 cpu)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak draft learning rate (cosine to a tenth)")
    parser.add_argument("--warmup", type=float, default=0.05)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--num-anchors", type=int, default=64, help="DSpark anchor blocks per sequence")
    parser.add_argument("--max-corpus-mb", type=float, help="a stable subset of the corpus (smoke runs)")
    parser.add_argument("--reserve", type=float, help="seconds kept for measuring and export (35 cuda, 20 cpu)")
    parser.add_argument("--log-every", type=int, default=20)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    t_start = time.time()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch, args.gen_batch = args.batch_size or (128 if cuda else 4), args.gen_batch or (512 if cuda else 8)
    deadline = t_start + args.minutes * 60 - (args.reserve if args.reserve is not None else (35.0 if cuda else 20.0))
    out = Path(args.out).resolve()
    if out == args.checkpoint.resolve():
        raise SystemExit("--out must not be the input checkpoint")
    torch.manual_seed(args.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # The measuring target runs as the release was measured (fp32, per-expert loop); on the GPU generation and
    # training use a second copy with NeMo's grouped experts under bf16 autocast, as train_tiny_v41 trains.
    config, tokenizer, tensors, eval_model, draft = load_checkpoint(args.checkpoint, device, False, args.num_anchors)
    fast_model = load_checkpoint(args.checkpoint, device, True, args.num_anchors)[3] if cuda else eval_model
    layer_ids = config.text_config.dspark_target_layer_ids
    eval_capture = FeatureCapture(eval_model, layer_ids)
    capture = FeatureCapture(fast_model, layer_ids) if cuda else eval_capture
    train_stream, heldout_stream, corpus = corpus_streams(args.checkpoint, tokenizer, args.max_corpus_mb)
    log(f"corpus: {corpus}")
    n_prompts, prompt_len, continuation = ACCEPTANCE_PROTOCOL[device.type]
    prompts = acceptance_prompts(heldout_stream, n_prompts, prompt_len, device)

    def acceptance(label: str) -> dict:  # in full fp32 (no TF32), as train_tiny_v41 measured the release
        torch.backends.cuda.matmul.allow_tf32 = False
        result = dspark_acceptance(eval_model, draft, eval_capture, prompts, continuation)
        torch.backends.cuda.matmul.allow_tf32 = True  # generation and training, as train_tiny_v41 trains
        log(f"acceptance {label}: {result}")
        return result

    before = acceptance("before")
    data = DistillationSet(fast_model, train_stream.to(device), args, tokenizer.eos_token_id, autocast, log)
    trained = distill(fast_model, draft, capture, data, args, batch, autocast, deadline, log)
    history, dataset = trained.pop("history"), data.summary()
    log(f"distillation set: {dataset}")
    log(f"trained: {trained}")
    after_trained = acceptance("after, the trained fp32 draft")

    merged = write_checkpoint(args.checkpoint, out, tensors, draft)
    main_sha256 = verify_main_model_unchanged(args.checkpoint / "model.safetensors", out / "model.safetensors")
    log(f"main-model tensors byte-identical to the input (sha256 {main_sha256[:16]})")
    load_released(eval_model, draft, merged, device)  # the draft as shipped: FP8/MXFP4 through NeMo's adapters
    after = acceptance("after, the exported draft")

    record = {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "replay": f"--sequences {dataset['sequences']} --steps {trained['steps']}",
        "seed": args.seed,
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({os.cpu_count()} cores)",
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "nemo_automodel": nemo_automodel.__version__,
        "input_checkpoint": str(args.checkpoint), "main_model_sha256": main_sha256,
        "corpus": corpus,
        "distillation_set": {**dataset, "generation": "bf16 autocast, grouped experts" if cuda else "fp32"},
        "training": {**trained, "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
                     "num_anchors": args.num_anchors, "schedule": "linear warmup, cosine to lr/10",
                     "loss": "NeMo DSpark: 0.1 CE + 0.9 probability L1 to the target + confidence BCE",
                     "precision": "bf16 autocast, fp32 master weights" if cuda else "fp32"},
        "history": history,
        "dspark_greedy_acceptance": {"before": before, "after": after, "after_before_export": after_trained},
        "wall_seconds": round(time.time() - t_start, 1),
    }
    (out / "distillation.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    log(f"wrote {out}: mean acceptance length {before['mean_acceptance_length']:.3f} -> "
        f"{after['mean_acceptance_length']:.3f}")


if __name__ == "__main__":
    main()
