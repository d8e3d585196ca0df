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
import hashlib
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
from types import SimpleNamespace

# NeMo wraps its expert activation in torch.compile; eager avoids a compiler dependency on the GPU box and keeps CPU
# runs bitwise eager (as in tools/goldens/v41_golden.py). --compile lifts this.
if "--compile" not in sys.argv:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

import nemo_automodel
from deepinfer.testing.tiny_tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, tokenizer_config
from deepinfer.testing.tiny_v41 import released_format
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map, _next_prime
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.moe.layers import Gate
from nemo_automodel.components.speculative.dspark import loss as dspark_loss
from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss

# NeMo computes the DSpark probability distance in checkpointed chunks of 128 draft tokens, sized for the released
# 129K vocabulary; with this vocabulary 16K-token chunks stay small and save thousands of kernel launches per step.
dspark_loss._compute_l1_dist_per_token.__kwdefaults__["chunk_size"] = 16384

# Every layer kind of V4.1 in nine layers, as in deepinfer/testing/tiny_v41.py: 0-1 sliding window only (1 with
# Engram); 2 a ratio-2 KV and index source; 3 reuses 2's KV and selection; 4 re-indexes 2's keys; 5 a ratio-1 KV
# source that publishes candidate blocks; 6 reuses 5; 7 re-indexes inside 5's candidates (with Engram); 8 a
# window-only decoder layer. Then the three DSpark stages (window only), reading the inputs of layers 6-8.
# Sized for about 8 minutes of training on one H200 and a 15.2 MB checkpoint: 12.5M parameters (7.1M of them in the
# MXFP4 routed experts; 2 of 8 active) plus 2.5M in the draft. Training windows of 512 tokens against a 64-token
# sliding window make the compressed paths carry the context: ratio-2 layers see up to 256 entries and select 32;
# ratio-1 layers see up to 512, layer 5 keeps 8 candidate blocks of 8 and layer 7 selects 32 inside them.
TRAINED_V41 = dict(
    vocab_size=3072,
    hidden_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=9,
    num_attention_heads=8,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=128,
    o_lora_rank=32,
    o_groups=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    sliding_window=64,
    hc_mult=4,
    compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0] + [0, 0, 0],  # + the three DSpark stages
    kv_source_layer_ids=[2, 5],
    index_source_layer_ids=[2, 4, 5, 7],
    index_n_heads=8,
    index_head_dim=32,
    index_topk=32,
    candidate_source_layer_id=5,
    candidate_topk_blocks=8,
    candidate_block_size=8,
    engram_layer_ids=[1, 7],
    engram_max_ngram_size=3,
    engram_vocab_size=2003,  # hash buckets per (n-gram size, head): primes just above this
    engram_n_heads=2,
    engram_head_dim=32,
    num_nextn_predict_layers=3,
    dspark_block_size=5,
    dspark_noise_token_id=2,  # <｜▁pad▁｜>: never a training target
    dspark_target_layer_ids=[6, 7, 8],
    dspark_markov_rank=32,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
    max_position_embeddings=4096,
    rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 512},
)

USER, ASSISTANT, THINK, END_THINK = SPECIAL_TOKENS[3:7]
# DeepSeek-V3.1/V4 chat encoding: BOS, the system prompt, then <｜User｜>message<｜Assistant｜></think>answer EOS per
# turn (non-thinking); the generation prompt ends with <｜Assistant｜></think>, or <｜Assistant｜><think> for thinking.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] -%}{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '" + USER + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + END_THINK + "' + message['content'] + eos_token -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '" + ASSISTANT + "' + ('" + THINK + "' if thinking is defined and thinking else '" + END_THINK + "') -}}"
    "{%- endif -%}"
)
TOPIC_QUESTIONS = (
    "Explain the Python topic '{}'.",
    "What does the Python language reference say about {}?",
    "Describe {} in Python.",
)
SAMPLE_PROMPTS = ("def fibonacci(n):", '"""Return the', "import os\n")


# ---------------------------------------------------------------------------------------------------- corpus
def _bucket(name: str) -> float:
    """A stable number in [0, 1) per document name, for the held-out split and subsampling."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def build_corpus(include_tests: bool, max_bytes: int | None) -> list[tuple[str, str, bool]]:
    """(name, text, is_chat) documents: stdlib ``*.py`` files and the pydoc topics as chat turns."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}  # codec tables; topics
    test_dirs = {"test", "tests", "idle_test"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if skip_dirs & set(parts) or (not include_tests and test_dirs & set(parts)):
            continue
        if path.name.startswith("bad") or any(p in ("data", "tokenizedata") for p in parts[:-1]):
            continue  # deliberately malformed test inputs
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\r\n", "\n")
        if text.strip():
            docs.append(("/".join(parts), text, False))
    from pydoc_data.topics import topics

    for key in sorted(topics):
        question = TOPIC_QUESTIONS[int(_bucket("q:" + key) * len(TOPIC_QUESTIONS))].format(key.replace("-", " "))
        docs.append((f"pydoc:{key}", json.dumps([question, topics[key].strip()]), True))
    if max_bytes is not None:  # smoke runs: a stable pseudo-random subset
        kept, total = [], 0
        for doc in sorted(docs, key=lambda d: _bucket("subset:" + d[0])):
            if total + len(doc[1]) > max_bytes:
                continue
            kept.append(doc)
            total += len(doc[1])
        docs = sorted(kept)
    return docs


def split_documents(docs: list[tuple[str, str, bool]], heldout: float) -> tuple[list, list]:
    """(train, held-out) documents: a document is held out by a hash of its name, whatever the subset."""
    return [d for d in docs if _bucket(d[0]) >= heldout], [d for d in docs if _bucket(d[0]) < heldout]


def chat_text(doc: str) -> str:
    question, answer = json.loads(doc)
    return BOS_TOKEN + USER + question + ASSISTANT + END_THINK + answer + EOS_TOKEN


# ---------------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, max_length: int, out: Path) -> PreTrainedTokenizerFast:
    """Byte-level BPE with DeepSeek's special tokens at fixed ids (BOS 0, EOS 1, pad 2, ...)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    # DeepSeek prepends BOS to every encoded prompt.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    config = {**tokenizer_config(max_length), "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), bos_token=BOS_TOKEN,
                                   eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def encode_documents(tokenizer: PreTrainedTokenizerFast, docs: list[tuple[str, str, bool]]) -> torch.Tensor:
    """One stream of ``BOS text EOS`` documents (chat documents carry their own BOS/EOS)."""
    backend = tokenizer.backend_tokenizer
    texts = [chat_text(text) if is_chat else BOS_TOKEN + text + EOS_TOKEN for _, text, is_chat in docs]
    ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return torch.tensor([i for doc in ids for i in doc], dtype=torch.int32)


# ---------------------------------------------------------------------------------------------------- model
def model_config(tokenizer: PreTrainedTokenizerFast, overrides: dict) -> DeepseekV41Config:
    text = dict(TRAINED_V41, **overrides)
    text["vocab_size"] = len(tokenizer)
    text["engram_compressed_vocab_size"] = _compressed_token_map(tokenizer)[1]
    text["engram_num_embeddings"] = engram_rows(text)
    text["dtype"] = "float32"  # fp32 master weights; bf16 autocast on GPU
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, dtype="float32")


def engram_rows(text: dict) -> list[int]:
    """Each Engram table holds exactly its hash buckets: NeMo's primes for every (n-gram size, head)."""
    seen, rows = set(), []
    for _ in text["engram_layer_ids"]:
        total = 0
        for _ in range(text["engram_max_ngram_size"] - 1):
            current = text["engram_vocab_size"] - 1
            for _ in range(text["engram_n_heads"]):
                current = _next_prime(current, seen)
                seen.add(current)
                total += current
        rows.append(total)
    return rows


def build_models(config: DeepseekV41Config, tokenizer, device: torch.device, num_anchors: int,
                 grouped_experts: bool = False):
    """NeMo's target and DSpark draft. ``grouped_experts``: torch._grouped_mm experts (bf16 on GPU only)."""
    backend = BackendConfig(attn="sdpa", experts="torch_mm" if grouped_experts else "torch",
                            dispatcher="torch", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                            enable_hf_state_dict_adapter=True)
    model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer)
    model.initialize_weights(dtype=torch.float32)
    text = config.text_config
    options = SimpleNamespace(
        num_draft_layers=text.num_nextn_predict_layers, target_layer_ids=text.dspark_target_layer_ids,
        block_size=text.dspark_block_size, num_anchors=num_anchors, mask_token_id=text.dspark_noise_token_id,
        markov_rank=text.dspark_markov_rank, markov_head_type="vanilla", confidence_head_alpha=1.0,
        confidence_head_with_markov=True, confidence_head_stop_gradient=False,
    )
    draft = config.build_dspark_draft(options)
    for module in (*model.modules(), *draft.modules()):
        if isinstance(module, Gate):
            # DeepSeek's auxiliary-loss-free balancing: NeMo's MoEConfig for V4.1 leaves the bias update off (it
            # fine-tunes released weights); from scratch it keeps the routed experts in use.
            module.bias_update_factor = 1e-3
    return model.to(device), draft.to(device)


def sync_draft_embeddings(model, draft) -> None:
    """The draft reads the target's embedding and head (frozen copies; the release stores neither under mtp.*)."""
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(model.lm_head.weight)
    draft.set_embedding_head_trainable(False)


class FeatureCapture:
    """DSpark target features, as NeMo's ``HFDSparkTargetModel`` takes them from a V4.1 target.

    ``get_dspark_target_feature_modules`` names each target layer's attention hyper-connection: its input is the
    layer's residual streams [batch, seq, hc_mult, hidden] after any Engram update; the streams are averaged and
    the layers concatenated: [batch, seq, len(dspark_target_layer_ids) * hidden].
    """

    def __init__(self, model, layer_ids):
        self.captured: dict[int, torch.Tensor] = {}
        modules = model.get_dspark_target_feature_modules(list(layer_ids))
        self.layer_ids = list(layer_ids)
        for layer_id, module in zip(self.layer_ids, modules):
            module.register_forward_pre_hook(self._hook(layer_id))

    def _hook(self, layer_id):
        def hook(_module, inputs):
            self.captured[layer_id] = inputs[0].detach()
        return hook

    def features(self) -> torch.Tensor:
        out = torch.cat([self.captured[i].mean(dim=2) for i in self.layer_ids], dim=-1)
        self.captured.clear()
        return out


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


# ---------------------------------------------------------------------------------------------------- training
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


# ---------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, batch: int, device, autocast) -> tuple[float, int]:
    """Mean next-token cross-entropy over non-overlapping windows of the held-out stream."""
    model.eval()
    n = (stream.numel() - 1) // seq_len
    total, count = 0.0, 0
    for start in range(0, n, batch):
        idx = torch.arange(start, min(start + batch, n)).unsqueeze(1) * seq_len + torch.arange(seq_len + 1)
        x = stream[idx].long().to(device)
        with autocast:
            logits = model(x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    return total / max(count, 1), count


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab: int, seq_len: int) -> float:
    """Held-out cross-entropy under add-one-smoothed training-split token frequencies (same targets as above)."""
    counts = torch.bincount(train.long(), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    n = (heldout.numel() - 1) // seq_len
    targets = heldout[1 : n * seq_len + 1].view(n, seq_len).flatten().long()
    return float(-logp[targets].mean())


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int, eos: int | None = None) -> torch.Tensor:
    """Greedy continuation by re-running the whole sequence for each token (NeMo's model has no KV cache)."""
    model.eval()
    for _ in range(new_tokens):
        nxt = model(ids).logits[:, -1].float().argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        if eos is not None and ids.shape[0] == 1 and int(nxt) == eos:
            break
    return ids


@torch.no_grad()
def dspark_acceptance(model, draft, capture, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Greedy DSpark acceptance on the target's own greedy continuations of held-out prompts.

    For every anchor in the continuation the draft proposes ``dspark_block_size`` tokens; greedy verification
    accepts the prefix that matches the target's argmax, plus the target's own (bonus) token. The Markov head reads
    the previous token, which inside an accepted prefix is the matched token, so teacher forcing on the target's
    continuation gives the acceptance that semi-autoregressive drafting gets. Returns the mean acceptance length
    (accepted + 1) and the per-position acceptance rates.
    """
    model.eval()
    draft.eval()
    seqs = greedy(model, prompts, new_tokens)
    out = model(seqs, return_hidden_states=True)
    features = capture.features()
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, prompts.shape[1] - 1 :] = 1  # anchors: last prompt token and the continuation
    saved = draft.num_anchors
    draft.num_anchors = seqs.shape[1]  # every valid anchor
    try:
        d = draft(input_ids=seqs, target_hidden_states=features, loss_mask=loss_mask,
                  target_last_hidden_states=out.hidden_states)
    finally:
        draft.num_anchors = saved
    match = (d.draft_logits.argmax(-1) == d.aligned_target_logits.argmax(-1)) & d.eval_mask
    full = d.eval_mask.all(-1) & d.block_keep_mask  # anchors with a whole block left to verify
    accepted = match.int().cumprod(-1)[full]
    return {
        "mean_acceptance_length": float(accepted.sum(-1).float().mean() + 1) if accepted.numel() else None,
        "acceptance_rate_by_position": [round(float(v), 4) for v in accepted.float().mean(0)],
        "anchors": int(full.sum()),
        "prompts": int(prompts.shape[0]),
        "prompt_tokens": int(prompts.shape[1]),
        "continuation_tokens": new_tokens,
    }


# (prompts, prompt tokens, continuation tokens) of the DSpark greedy acceptance measurement
ACCEPTANCE_PROTOCOL = {"cuda": (32, 128, 96), "cpu": (2, 32, 16)}


def acceptance_prompts(stream: torch.Tensor, n_prompts: int, prompt_len: int, device) -> torch.Tensor:
    """Evenly spaced windows of the held-out stream."""
    n_prompts = max(1, min(n_prompts, (stream.numel() - 1) // prompt_len))
    starts = torch.arange(n_prompts) * ((stream.numel() - prompt_len) // n_prompts)
    return stream[starts.unsqueeze(1) + torch.arange(prompt_len)].long().to(device)


# ---------------------------------------------------------------------------------------------------- export
def released_draft_tensors(draft) -> dict[str, torch.Tensor]:
    """The DSpark stages ``mtp.*`` in the released layout and dtypes."""
    drafted = draft.state_dict_adapter.to_hf({k: v.detach().cpu() for k, v in draft.state_dict().items()})
    return {k: v for k, v in released_format(drafted).items() if k.startswith("mtp.")}


def export(model, draft, config: DeepseekV41Config, out: Path) -> dict[str, torch.Tensor]:
    native = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tensors = released_format(model.state_dict_adapter.to_hf(native))
    tensors.update(released_draft_tensors(draft))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["dtype"] = "bfloat16"
    config_dict["text_config"]["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    return tensors


def load_released(model, draft, tensors: dict[str, torch.Tensor], device) -> None:
    """Load the exported (quantized) tensors back through NeMo's own adapters, as tools/goldens/v41_golden.py does."""
    native = model.state_dict_adapter.from_hf({k: v.clone() for k, v in tensors.items() if not k.startswith("mtp.")})
    missing, unexpected = model.load_state_dict({k: v.float().to(device) for k, v in native.items()}, strict=False)
    missing = [k for k in missing if "engram_hash" not in k]
    if missing or unexpected:
        raise RuntimeError(f"reload mismatch: missing {missing} unexpected {unexpected}")
    mtp = {k: v.clone() for k, v in tensors.items() if k.startswith(("mtp.", "embed.", "head."))}
    native = draft.state_dict_adapter.from_hf(mtp)
    missing, unexpected = draft.load_state_dict({k: v.float().to(device) for k, v in native.items()}, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"draft reload mismatch: missing {missing} unexpected {unexpected}")
    sync_draft_embeddings(model, draft)


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
