"""Train the small DeepSeek-V4.1 model that ships inside DeepInfer.

The model is NVIDIA NeMo AutoModel's public PyTorch implementation of DeepSeek-V4.1 (``DeepseekV41ForCausalLM``
and its DSpark draft), trained from scratch on a corpus every machine has: the running Python's standard library
source plus the ``pydoc_data`` documentation topics (rendered as chat turns). The checkpoint is written in the
released V4.1 layout (FP8 32x32 block weights, MXFP4 experts, FP8 Engram tables, ``mtp.*`` DSpark stages) with a
byte-level BPE tokenizer trained on the same corpus and DeepSeek's special tokens and chat encoding.

NeMo AutoModel pins its own transformers, so this runs in its own environment, never in DeepInfer's.

CPU (the NeMo venv that ``tools/goldens/v41_golden.py`` describes; an end-to-end smoke run of a few minutes on 2 cores):

    PYTHONPATH=. /work/nemo-venv/bin/python tools/training/train_tiny_v41.py --out /tmp/tiny-v41 --device cpu \\
        --minutes 2 --max-corpus-mb 3

GPU (one H200: Python 3.12, torch 2.11+cu130, transformers 5.17, no network). Transformers 5.17 serves every
import of NeMo's deepseek_v41 model, DSpark draft and DSpark loss (NeMo's metadata pins 5.18, which is not needed).
What the box lacks travels as wheels in the git-ignored ``.wheels/``: NeMo AutoModel, pydantic (imported by
``nemo_automodel/__init__``), Pillow (imported by the V4/V4.1 image processing modules), pluggy (imported by
``deepinfer/__init__``, which the FP8/MXFP4 export helpers live under). Fetch them where there is network:

    pip download --no-deps -d .wheels nemo-automodel==0.7.0 pydantic==2.14.4 typing-inspection==0.4.5 \\
        annotated-types==0.8.0 typing-extensions==4.16.0 pluggy==1.7.0
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \\
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .wheels pydantic-core==2.50.5 pillow==13.0.0

and on the GPU box, from the repository root (about 9.5 minutes in all):

    pip install --no-deps --no-index --target /tmp/site .wheels/*.whl
    PYTHONPATH=.:/tmp/site python tools/training/train_tiny_v41.py --out /tmp/tiny-v41 --device cuda --minutes 9 --seed 0

``--minutes`` bounds the run from corpus to export (imports come before it). Training is time-boxed: the
learning-rate schedules follow elapsed time, and the steps taken are recorded in ``training.json``;
``--steps N --draft-steps M`` replays a run by step count instead (bitwise on CPU; on a GPU, bf16 autocast,
torch._grouped_mm experts and SDPA are fast but not bitwise deterministic).

Output directory: ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` and
``training.json`` (command, seeds, versions, corpus, steps, wall time, losses, held-out loss and perplexity against a
unigram baseline, DSpark greedy acceptance, greedy samples).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from contextlib import nullcontext
from pathlib import Path

# NeMo wraps its expert activation in torch.compile; eager avoids a compiler dependency on the GPU box and keeps CPU
# runs bitwise eager (as in tools/goldens/v41_golden.py). --compile lifts this.
if "--compile" not in sys.argv:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
import torch.nn.functional as F
import transformers

import nemo_automodel
from nemo_automodel.components.moe.layers import Gate
from nemo_automodel.components.speculative.dspark import loss as dspark_loss
from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss
from tools.training.tiny_v41_corpus import build_corpus, encode_documents, split_documents, train_tokenizer
from tools.training.tiny_v41_metrics import (
    ACCEPTANCE_PROTOCOL, SAMPLE_PROMPTS, acceptance_prompts, dspark_acceptance, greedy, heldout_loss, unigram_loss,
)
from tools.training.tiny_v41_model import (
    TRAINED_V41, FeatureCapture, build_models, export, load_released, model_config, sync_draft_embeddings,
)

# NeMo computes the DSpark probability distance in checkpointed chunks of 128 draft tokens, sized for the released
# 129K vocabulary; with this vocabulary 16K-token chunks stay small and save thousands of kernel launches per step.
dspark_loss._compute_l1_dist_per_token.__kwdefaults__["chunk_size"] = 16384


# ---------------------------------------------------------------------------------------------------- training
def parameter_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on projection matrices only (not embeddings, Engram tables, norms, mHC, sinks, biases)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        embedding = name.endswith(("embed_tokens.weight", "embed.weight"))
        matrix = p.dim() >= 2 and not embedding and not name.endswith(("hc.fn",))
        (decay if matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(progress: float, warmup: float, final: float = 0.1) -> float:
    """Linear warmup over ``warmup`` of the run, then cosine decay to ``final``."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    t = min((progress - warmup) / max(1 - warmup, 1e-9), 1.0)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t))


def update_gate_biases(module: torch.nn.Module) -> None:
    for gate in module.modules():
        if isinstance(gate, Gate) and gate._cumulative_expert_load is not None:
            gate.update_bias()


def dspark_step_loss(draft, inputs, features, final_hidden, loss_mask):
    """NeMo's DSpark objective: 0.1 cross-entropy on the data + 0.9 probability distance (TV) to the target,
    plus the confidence head's BCE against the resulting per-token acceptance (DSparkTrainerModule's defaults)."""
    outputs = draft(input_ids=inputs, target_hidden_states=features, loss_mask=loss_mask,
                    target_last_hidden_states=final_hidden)
    return compute_dspark_loss(outputs=outputs, loss_decay_gamma=None, ce_loss_alpha=0.1, l1_loss_alpha=0.9,
                               confidence_head_alpha=1.0, return_terms=True)


def train(model, draft, capture, stream: torch.Tensor, args, batch: int, device, autocast, deadline: float,
          log) -> dict:
    """Two phases, time-boxed (or by step count with --steps/--draft-steps).

    1. The target learns the corpus; after ``--draft-start`` of the phase the draft trains alongside on the target's
       detached features. The draft's objective never reaches the target (NeMo detaches the features; embedding and
       head are frozen copies), so one target forward serves both.
    2. ``--draft-only`` of the time: the target is final and runs forward only (about a third of a main step); the
       draft fits the distribution it will be verified against.
    """
    cuda = device.type == "cuda"
    fused = {"fused": True} if cuda else {}
    opt = torch.optim.AdamW(parameter_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), **fused)
    dopt = torch.optim.AdamW(parameter_groups(draft, args.weight_decay), lr=args.draft_lr, betas=(0.9, 0.95), **fused)
    stream = stream.to(device)
    data_gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    window = torch.arange(args.seq_len + 1, device=device)
    loss_mask = torch.ones(batch, args.seq_len, dtype=torch.long, device=device)

    def next_batch() -> torch.Tensor:  # random windows of the packed document stream
        starts = torch.randint(0, stream.numel() - args.seq_len - 1, (batch,), generator=data_gen).to(device)
        return stream[starts.unsqueeze(1) + window].long()

    def draft_step(draft_progress: float, inputs, features, final_hidden) -> dict:
        for group in dopt.param_groups:
            group["lr"] = args.draft_lr * lr_factor(draft_progress, 0.05)
        with autocast:
            loss, terms = dspark_step_loss(draft, inputs, features, final_hidden, loss_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        dopt.step()
        dopt.zero_grad(set_to_none=True)
        update_gate_biases(draft)
        return {"draft_loss": loss.detach(), "draft_ce": terms["ce_loss"],
                "tau": terms["tau_num"] / terms["tau_den"].clamp_min(1)}

    history, steps, t0 = [], {"main": 0, "draft_only": 0}, time.time()
    main_seconds = max(deadline - t0, 1.0) * (1 - args.draft_only)

    def record(phase: str, step: int, row: dict) -> None:
        if step % args.log_every and step != 1:
            return
        row = {"step": step, "phase": phase, "t": round(time.time() - t0, 1),
               **{k: round(float(v), 5) for k, v in row.items()}}
        history.append(row)
        log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))

    def main_progress() -> float:
        if args.steps is not None:
            return steps["main"] / args.steps if args.steps else 1.0
        return (time.time() - t0) / main_seconds

    model.train()
    draft.train()
    draft_started = output = features = None
    while (p := main_progress()) < 1:
        x = next_batch()
        inputs, labels = x[:, :-1], x[:, 1:]
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(p, args.warmup)
        with autocast:
            output = model(inputs, return_hidden_states=True)
            loss = F.cross_entropy(output.logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        features = capture.features()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        row = {"lr": opt.param_groups[0]["lr"], "loss": loss.detach(), "grad_norm": grad_norm}
        if p >= args.draft_start:
            draft_started = steps["main"] if draft_started is None else draft_started
            sync_draft_embeddings(model, draft)  # the head the features were computed with
            dp = (p - args.draft_start) / (1 - args.draft_start) * (1 - args.draft_only)
            row.update(draft_step(dp, inputs, features, output.hidden_states.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_gate_biases(model)
        steps["main"] += 1
        record("main", steps["main"], row)
    del output, features
    t1 = time.time()

    model.eval()
    sync_draft_embeddings(model, draft)
    phase2_seconds = max(deadline - t1, 0.0)

    def draft_progress() -> float:
        if args.steps is not None:
            return steps["draft_only"] / args.draft_steps if args.draft_steps else 1.0
        return (time.time() - t1) / phase2_seconds if phase2_seconds > 0 else 1.0

    while (q := draft_progress()) < 1:
        inputs = next_batch()[:, :-1]
        with torch.no_grad(), autocast:
            output = model(inputs, return_hidden_states=True)
        row = draft_step(1 - args.draft_only + args.draft_only * q, inputs, capture.features(), output.hidden_states)
        steps["draft_only"] += 1
        record("draft", steps["draft_only"], {"lr": dopt.param_groups[0]["lr"], **row})
    t2 = time.time()
    main_tokens = steps["main"] * batch * args.seq_len
    return {
        "main_steps": steps["main"], "draft_only_steps": steps["draft_only"], "draft_started_at_step": draft_started,
        "tokens_seen": (steps["main"] + steps["draft_only"]) * batch * args.seq_len, "main_tokens": main_tokens,
        "main_seconds": round(t1 - t0, 1), "draft_only_seconds": round(t2 - t1, 1),
        "main_tokens_per_second": round(main_tokens / max(t1 - t0, 1e-9)),
        "history": history,
    }


# ---------------------------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget from corpus to export")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="main-phase steps (replaces the time box)")
    parser.add_argument("--draft-steps", type=int, help="draft-only steps after the main phase (with --steps)")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: 128 on cuda, 4 on cpu)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of the main phase")
    parser.add_argument("--draft-start", type=float, default=0.2,
                        help="fraction of the main phase after which the draft trains alongside")
    parser.add_argument("--draft-only", type=float, default=0.12,
                        help="fraction of the training time for the draft alone, target frozen")
    parser.add_argument("--num-anchors", type=int, default=64, help="DSpark anchor blocks per sequence")
    parser.add_argument("--vocab-size", type=int, default=TRAINED_V41["vocab_size"])
    parser.add_argument("--heldout", type=float, default=0.03, help="held-out fraction of documents")
    parser.add_argument("--no-tests", action="store_true", help="leave the stdlib's test packages out")
    parser.add_argument("--max-corpus-mb", type=float, help="a stable subset of the corpus (smoke runs)")
    parser.add_argument("--reserve", type=float, 
                        help="seconds kept for evaluation and export (default: 75 cuda, 45 cpu)")
    parser.add_argument("--eval-tokens", type=int, help="cap on held-out tokens evaluated (default: all on cuda)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--experts", choices=("torch_mm", "torch"),
                        help="NeMo's training expert backend: torch._grouped_mm (cuda default) or a per-expert loop")
    parser.add_argument("--compile", action="store_true", help="let NeMo's torch.compile'd activations compile")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    t_start = time.time()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch = args.batch_size or (128 if cuda else 4)
    reserve = args.reserve if args.reserve is not None else (75.0 if cuda else 45.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # -- corpus, held-out split, tokenizer
    docs = build_corpus(not args.no_tests, None if args.max_corpus_mb is None else int(args.max_corpus_mb * 1e6))
    train_docs, heldout_docs = split_documents(docs, args.heldout)
    corpus_bytes = sum(len(d[1].encode()) for d in docs)
    train_bytes = sum(len(d[1].encode()) for d in train_docs)
    log(f"corpus: {len(docs)} documents, {corpus_bytes / 1e6:.2f} MB ({len(heldout_docs)} held out)")
    tokenizer_texts = ["\n".join(json.loads(text)) if chat else text for _, text, chat in train_docs]
    tokenizer = train_tokenizer(tokenizer_texts, args.vocab_size, TRAINED_V41["max_position_embeddings"], out)
    train_stream = encode_documents(tokenizer, train_docs)
    heldout_stream = encode_documents(tokenizer, heldout_docs)
    log(f"tokenizer: {len(tokenizer)} tokens; train {train_stream.numel():,} tokens "
        f"({train_bytes / train_stream.numel():.2f} bytes/token), held-out {heldout_stream.numel():,}")

    # -- NeMo's model and DSpark draft, trained
    config = model_config(tokenizer, {})
    experts = args.experts or ("torch_mm" if cuda else "torch")
    model, draft = build_models(config, tokenizer, device, args.num_anchors, grouped_experts=experts == "torch_mm")
    sync_draft_embeddings(model, draft)
    capture = FeatureCapture(model, config.text_config.dspark_target_layer_ids)
    n_params = sum(p.numel() for p in model.parameters())
    n_draft = sum(p.numel() for n, p in draft.named_parameters() if not n.startswith(("embed_tokens", "lm_head")))
    log(f"model: {n_params / 1e6:.2f}M parameters (+{n_draft / 1e6:.2f}M DSpark draft), {experts} experts, {device}")
    trained = train(model, draft, capture, train_stream, args, batch, device, autocast,
                    t_start + args.minutes * 60 - reserve, log)
    log(f"trained: {trained['main_steps']} main + {trained['draft_only_steps']} draft-only steps, "
        f"{trained['tokens_seen']:,} tokens, {trained['main_tokens_per_second']:,} main tokens/s")

    # -- held-out loss of the trained weights against the unigram baseline
    eval_cap = args.eval_tokens if args.eval_tokens is not None else (None if cuda else 8 * args.seq_len)
    eval_stream = heldout_stream if eval_cap is None else heldout_stream[: eval_cap + 1]
    eval_batch = 32 if cuda else 4
    trained_loss, n_eval = heldout_loss(model, eval_stream, args.seq_len, eval_batch, device, autocast)
    unigram = unigram_loss(train_stream, eval_stream, len(tokenizer), args.seq_len)
    log(f"held-out loss {trained_loss:.4f} (unigram {unigram:.4f}) over {n_eval:,} tokens")

    # -- export; then the checkpoint as the engine sees it: the exported FP8/MXFP4 tensors loaded back through
    #    NeMo's adapters into a fresh fp32 model (per-expert loop, no TF32), as tools/goldens/v41_golden.py does
    tensors = export(model, draft, config, out)
    del model, draft, capture
    if cuda:
        torch.cuda.empty_cache()
        torch.backends.cuda.matmul.allow_tf32 = False
    model, draft = build_models(config, tokenizer, device, args.num_anchors)
    load_released(model, draft, tensors, device)
    capture = FeatureCapture(model, config.text_config.dspark_target_layer_ids)
    released_loss, _ = heldout_loss(model, eval_stream, args.seq_len, eval_batch, device, nullcontext())
    log(f"held-out loss {released_loss:.4f} with the exported FP8/MXFP4 weights (fp32)")

    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        new = greedy(model, ids, 48 if cuda else 24, eos=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
        samples.append({"prompt": prompt, "token_ids": new, "text": tokenizer.decode(new)})
        log(f"sample {prompt!r} -> {samples[-1]['text']!r}")

    n_prompts, prompt_len, continuation = ACCEPTANCE_PROTOCOL[device.type]
    prompts = acceptance_prompts(heldout_stream, n_prompts, prompt_len, device)
    acceptance = dspark_acceptance(model, draft, capture, prompts, continuation)
    log(f"DSpark greedy acceptance at draft length {config.text_config.dspark_block_size}: {acceptance}")

    size = (out / "model.safetensors").stat().st_size
    history = trained.pop("history")
    record = {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "replay": f"--steps {trained['main_steps']} --draft-steps {trained['draft_only_steps']}",
        "seed": args.seed,
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({os.cpu_count()} cores)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "nemo_automodel": nemo_automodel.__version__,
        "corpus": {
            "stdlib": sysconfig.get_paths()["stdlib"], "documents": len(docs), "bytes": corpus_bytes,
            "train_documents": len(train_docs), "train_bytes": train_bytes, "train_tokens": train_stream.numel(),
            "heldout_documents": len(heldout_docs), "heldout_tokens": heldout_stream.numel(),
            "include_tests": not args.no_tests, "max_corpus_mb": args.max_corpus_mb, "heldout_fraction": args.heldout,
            "pydoc_topics": "as chat turns: BOS <｜User｜>question<｜Assistant｜></think>topic text EOS",
        },
        "tokenizer": {"vocab_size": len(tokenizer), "bytes_per_token": round(train_bytes / train_stream.numel(), 3)},
        "model": {
            "parameters": n_params, "draft_parameters": n_draft, "checkpoint_bytes": size,
            "dspark_target_features": "per dspark_target_layer_ids layer, the mean over the hc streams of the input "
                                      "of its attention hyper-connection (after Engram); concatenated",
        },
        "training": {
            "batch_size": batch, "seq_len": args.seq_len, "lr": args.lr, "draft_lr": args.draft_lr,
            "weight_decay": args.weight_decay, "warmup": args.warmup, "draft_start": args.draft_start,
            "draft_only": args.draft_only, "num_anchors": args.num_anchors, "experts_backend": experts,
            "precision": "bf16 autocast, fp32 master weights" if cuda else "fp32",
            **trained, "epochs": round(trained["main_tokens"] / train_stream.numel(), 2),
        },
        "eval": {
            "heldout_tokens": n_eval,
            "heldout_loss": round(released_loss, 4),
            "heldout_perplexity": round(math.exp(released_loss), 2),
            "heldout_loss_before_export": round(trained_loss, 4),
            "unigram_loss": round(unigram, 4),
            "unigram_perplexity": round(math.exp(unigram), 2),
            "note": "heldout_loss: the exported FP8/MXFP4 checkpoint in fp32; before_export: the trained weights",
        },
        "dspark_greedy_acceptance": acceptance,
        "samples": samples,
        "history": history,
        "wall_seconds": round(time.time() - t_start, 1),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    log(f"wrote {out}: model.safetensors {size / 1e6:.2f} MB, {time.time() - t_start:.0f}s in all")


if __name__ == "__main__":
    main()
