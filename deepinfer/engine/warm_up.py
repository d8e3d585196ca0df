"""A server's warm-up before its first request: the shapes it will meet, run once on made-up prompts.

A Triton kernel is built the first time it runs at a new specialisation (its block sizes, chosen from a step's
token count), and a decode step's CUDA graph is captured the first time its batch size comes up; each takes
0.1-1 s, which a served request would otherwise wait through (2026-12-05, H100: 25 builds and a capture inside
a timed `bench serve` run after a client-side warm-up, TTFT 2.5 s). So the server runs, before it says it is
ready: one prompt of each length in ``PREFILL_TOKENS`` (every few-rows GEMM tile and MoE block table bucket, the
autotuned FP8 GEMM's range, the cuBLAS route, the tiled mHC, the torch block table), then a batch of ``DECODE_STEPS``
decode steps at every CUDA-graph batch size up to ``max_num_seqs`` (with the measured draft policy, once for each
draft length it chooses from: each has its own graphs). A decode graph is also fixed to a context bucket (a power of
two from ``cuda_graphs.MIN_CONTEXT``), so the sweep is run again, a few steps long, in each bucket up to twice the
longest prefill chunk (``context_buckets``): past it a request's prefill already takes several steps, and a capture
costs less than the prefill before it. Those batches share one prompt of half the bucket: the first batch (one
request) prefills it, the larger ones read it from the prefix cache. The prefill sweep's prompts are
random token ids, distinct so no prefix-cache hit shortens them; the counters a client reads (tokens, requests, step
times, drafts) are reset afterwards, the process's builds and captures are not (they are what the warm-up is for).
The measured policy keeps the step costs the sweep booked but not its acceptance: random text accepts little, and
requests of ``CONTEXT_STEPS`` tokens cut most drafts, so the shares it booked (0.60 / 0.16 / 0.06 / 0.03 / 0.01 by
position where the run after it accepted 0.63 / 0.36 / 0.26 / 0.18 / 0.14: H100, V4.1-Flash shapes, synthetic
L = 2.8, 2026-12-06) kept the policy on plain steps for the hundreds of decisions until its next probe.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from deepinfer.logger import init_logger
from deepinfer.runner import cuda_graphs
from deepinfer.runtime import kernel_compiles
from deepinfer.sampling_params import SamplingParams

logger = init_logger(__name__)

# one prompt each: token counts on both sides of every count-chosen kernel variant (few-rows GEMM tiles 8/16/32/64,
# the autotuned GEMM at 65-191 rows, the cuBLAS route from 192, the tiled mHC from 256, the torch block table past 512)
PREFILL_TOKENS = (5, 12, 24, 48, 64, 100, 150, 300, 600)
DECODE_PROMPT_TOKENS = 5
DECODE_STEPS = 16  # enough for the measured draft policy's warm-up (two booked runs of a length, from their third step)
CONTEXT_STEPS = 3  # decode steps in each larger context bucket: the first captures its graph


def warm_up(llm) -> dict:
    """Runs ``llm``'s warm-up sweep (see the module's text); returns what it did: the prompt lengths, the decode
    batch sizes, seconds, Triton kernels built and CUDA graphs captured."""
    engine = llm.engine
    started, built, captured = time.perf_counter(), kernel_compiles.count(), cuda_graphs.captures
    ids = _RandomPrompts(engine)
    lengths = [n for n in PREFILL_TOKENS if n + 2 <= engine.max_model_len]
    for n in lengths:
        llm.generate([ids.prompt(n)], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    sizes = decode_batch_sizes(engine.config.max_num_seqs)
    steps = min(DECODE_STEPS, engine.max_model_len - DECODE_PROMPT_TOKENS - 1)
    buckets = context_buckets(engine.max_model_len, engine.config.max_num_batched_tokens)
    if buckets and not engine.config.enable_prefix_caching:  # each request would prefill the shared prompt anew
        logger.info("warm-up: prefix caching is off, so decode graphs past %d tokens of context are captured when "
                    "first met", cuda_graphs.MIN_CONTEXT)
        buckets = []
    kept_acceptance = _acceptance_of(engine.speculator)
    for choices in _decode_sweeps(engine.speculator):
        with _policy_held(engine.speculator, choices):
            for size in sizes:
                llm.generate([ids.prompt(DECODE_PROMPT_TOKENS) for _ in range(size)],
                             SamplingParams(max_tokens=steps, ignore_eos=True), use_tqdm=False)
            for bucket in buckets:
                shared = ids.prompt(bucket // 2)  # prefilled by the first batch (one request), then cached
                for size in sizes:
                    llm.generate([shared] * size, SamplingParams(max_tokens=CONTEXT_STEPS, ignore_eos=True),
                                 use_tqdm=False)
    if kept_acceptance is not None:
        engine.speculator.policy.restore_acceptance(kept_acceptance)
    engine.reset_counters()
    done = {"prefill_tokens": lengths, "decode_batch_sizes": sizes, "context_buckets": [cuda_graphs.MIN_CONTEXT]
            + buckets, "seconds": round(time.perf_counter() - started, 2),
            "kernels_built": kernel_compiles.count() - built, "graphs_captured": cuda_graphs.captures - captured}
    logger.info("warm-up: prompts of %s tokens, decode batches of %s in contexts of %s tokens, in %.1f s (%d Triton "
                "kernels built, %d CUDA graphs captured)", lengths, sizes, done["context_buckets"], done["seconds"],
                done["kernels_built"], done["graphs_captured"])
    return done


def context_buckets(max_model_len: int, max_num_batched_tokens: int) -> list[int]:
    """The decode graphs' context buckets past the first that the warm-up runs: each up to ``max_model_len`` and
    twice the longest prefill chunk (a bucket's shared prompt, half of it, is then one chunk)."""
    buckets, bucket = [], 2 * cuda_graphs.MIN_CONTEXT
    while bucket <= min(max_model_len, 2 * max_num_batched_tokens):
        buckets.append(bucket)
        bucket *= 2
    return buckets


def warm_up_server(llm, wanted: bool | None) -> None:
    """A server's warm-up: ``wanted`` (--warm-up), or where it is None, on a GPU (a CPU builds and captures nothing:
    there the warm-up would only delay the server's start)."""
    if wanted is None:
        wanted = llm.engine.device.type == "cuda"
    if wanted:
        warm_up(llm)


def _decode_sweeps(speculator) -> list[tuple[int, ...] | None]:
    """The draft lengths each decode sweep holds the measured policy to: one sweep without a policy (None), else
    one for each length it chooses from (its step at each batch size has its own CUDA graph, and a probe of a length
    at a size a run's end shrinks to must not capture one: H100, 2026-12-06, a batch-16 probe with 5 drafts captured
    inside a timed batch-32 run). The policy books the steps' costs, as it would a run's."""
    if speculator is None or speculator.policy is None:
        return [None]
    return [(k,) for k in speculator.policy_choices]


def _acceptance_of(speculator):
    """The measured policy's acceptance counts (None without one), for the warm-up to put back."""
    policy = speculator.policy if speculator is not None else None
    return None if policy is None else policy.acceptance_counts()


@contextmanager
def _policy_held(speculator, choices: tuple[int, ...] | None):
    """The policy chooses only from ``choices`` inside the block (None: left alone)."""
    if choices is None:
        yield
        return
    kept, speculator.policy_choices = speculator.policy_choices, choices
    try:
        yield
    finally:
        speculator.policy_choices = kept


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """The CUDA graphs' batch sizes a server of ``max_num_seqs`` requests meets, and ``max_num_seqs`` itself."""
    return sorted({s for s in cuda_graphs.BATCH_SIZES if s < max_num_seqs} | {max_num_seqs})


class _RandomPrompts:
    """Random token ids of the vocabulary, no special or image token among them, no two prompts alike."""

    def __init__(self, engine):
        self.vocab = engine.model_config.vocab_size
        excluded = set(engine.tokenizer.all_special_ids)
        if getattr(engine.model_config, "image_token_id", None) is not None:
            excluded.add(engine.model_config.image_token_id)
        self.excluded = torch.tensor(sorted(excluded), dtype=torch.long)
        self.generator = torch.Generator().manual_seed(0)

    def prompt(self, length: int) -> dict:
        ids = torch.randint(0, self.vocab, (length,), generator=self.generator)
        while (clash := torch.isin(ids, self.excluded)).any():
            ids[clash] = torch.randint(0, self.vocab, (int(clash.sum()),), generator=self.generator)
        return {"prompt_token_ids": ids.tolist()}
