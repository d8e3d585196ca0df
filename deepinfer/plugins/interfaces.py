"""What the objects returned by the hooks must provide.

Shapes use T = tokens in the step (all requests flattened), H = heads, D = head dim,
N = rows of a paged pool, K = keys per query, B = rows being sampled, V = vocabulary.
Index tensors are int64 and use -1 for "no key here".

Every backend also says whether its calls may be captured in a CUDA graph (``graph_safe``): no host
synchronisation (``.item()``, ``.tolist()``, ``nonzero``, boolean-mask indexing) and output shapes that depend
only on input shapes. The engine replays decode steps from CUDA graphs only when every backend of the model is.

A backend may also declare ``batch_invariant = True``: a row's result depends on that row alone (for attention, on
its own index list, not on how far the step padded it), inside the step context of batch-invariant mode (its
products and row reductions in fixed tiles). With ``DEEPINFER_BATCH_INVARIANT=1`` the engine refuses a backend that
does not declare it, so the mode never runs with a weaker guarantee than it names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch


class AttentionBackend(Protocol):
    name: str
    graph_safe: bool

    def sparse_attention(
        self,
        q: torch.Tensor,
        sources: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One softmax per (token, head) over the union of keys named by ``sources``.

        ``q`` is [T, H, D]. Each source is ``(rows [N, D], indices [T, K])``: key j of query t
        is ``rows[indices[t, j]]`` and is also its value (K = V). ``rows`` is a tensor or, with
        ``kv_cache_dtype="fp8"``, ``deepinfer.runtime.fp8_kv.FP8Rows`` (indexing it dequantizes).
        ``sinks`` [H] (fp32) enters only the softmax denominator. Returns [T, H, D] in ``q``'s dtype.
        """

    def compress_pool(self, state: torch.Tensor, rows: torch.Tensor, ratio: int, overlap: int,
                      norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """V4's compressor pooling: one entry per closing window, [n, D] fp32.

        ``state`` [S, 2 * overlap * D] fp32 holds each token's ``[kv | score]`` row; ``rows`` [n, overlap * ratio]
        names the state rows a window pools (-1: before the sequence start). With ``overlap`` 2 the first
        ``ratio`` rows contribute their first D channels and the last ``ratio`` their second D. Per channel, a
        softmax over the rows' scores weights their kv; the sum is RMS-normalized and scaled by ``norm_weight``.
        ``deepinfer.runtime.ops.compress_pool`` is the reference.
        """

    def store_compressor_rows(self, state: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                              position_bias: torch.Tensor, positions: torch.Tensor) -> None:
        """Writes V4's compressor-state rows at ``slots`` [T] of ``state`` (the layout ``compress_pool`` reads):
        ``[kv | score + position_bias[position % R]]`` in fp32, from the projections ``kv`` and ``score`` [T, C]
        (any float dtype), ``position_bias`` [R, C] fp32 and ``positions`` [T] (``deepinfer.runtime.ops.compressor_rows``
        is the reference)."""

    def rotate(self, x: torch.Tensor, phases: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
        """RoPE: ``x`` [T, D] or [T, H, D] with its trailing ``rope_dim`` channels, read as interleaved pairs
        (x[2i], x[2i+1]), multiplied as complex numbers by ``phases`` [T, rope_dim/2] complex64 (their conjugates
        when ``inverse``), in fp32; the other channels unchanged; ``x``'s dtype (``deepinfer.runtime.ops.rotate_pairs``
        is the reference)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The model's RMSNorms that no other kernel fuses (attention's query, key and per-head norms, the final
        norm): ``x`` [..., D] RMS-normalized over its last dim in fp32, times ``weight`` [D] (fp32) when given, in
        ``x``'s dtype (``deepinfer.runtime.ops.rms_norm`` is the reference)."""

    def round_to_format(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """``x`` [..., D] quantized to a V4.1 cache format and dequantized back, along its last dim, in ``x``'s
        dtype: ``"fp8"`` (e4m3, a power-of-two scale per 32 channels), ``"mxfp4"`` (e2m1, a power-of-two scale per
        32) or ``"nvfp4"`` (e2m1, an e4m3 scale per 16); bit for bit as ``deepinfer.runtime.cache_formats``."""

    def store_rows(self, pool, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``rows`` [n, D] at ``slots`` [n] (all valid) of a cache pool the attention reads: a row tensor
        (in its dtype) or ``FP8Rows`` (quantized; ``deepinfer.runtime.fp8_kv.store`` is the reference)."""

    def padded_slots(self, layout, inputs):
        """Every slot a padded decode step (what a CUDA graph replays) reads or writes: ``layout`` a
        ``deepinfer.runtime.slots.SlotLayout``, ``inputs`` the step's ``StepInputs`` (``scratch_rows`` set). Returns a
        ``deepinfer.runtime.slots.PaddedSlots``, equal to what ``deepinfer.runtime.slots.padded_slots`` (the reference)
        computes."""

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        candidates: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        """Lightning-indexer selection.

        ``q`` [T, Hi, Di], ``weights`` [T, Hi] (already scaled), ``keys`` [N, Di] pool rows,
        ``candidates`` [T, C] row indices into ``keys`` (-1 = not visible to that query).
        Score ``sum_h weights[t,h] * relu(q[t,h] . keys[c])`` and return the row indices of
        the ``min(topk, C)`` best visible candidates, [T, min(topk, C)], -1 where fewer exist.
        """

    def indexer_scores(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        candidates: torch.Tensor,
    ) -> torch.Tensor:
        """The same scores as ``indexer_topk``, unselected: [T, C] fp32, -inf where ``candidates`` is -1.

        V4.1's two-level indexer selects blocks from them before it selects entries.
        """


class VisionAttentionBackend(Protocol):
    name: str

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Full bidirectional attention over one image's patches: ``q``, ``k``, ``v`` [P, H, D] (RoPE applied),
        softmax scale D^-0.5; returns [P, H * D] in ``q``'s dtype
        (``deepinfer.models.deepseek_v41.vision.vision_attention`` is the reference)."""


class LinearBackend(Protocol):
    name: str
    graph_safe: bool

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, activation_block: int) -> torch.Tensor:
        """``x W^T`` for a quantized weight as the checkpoint stores it.

        ``x`` [..., C]. ``weight`` is FP8 e4m3 [R, C] with an e8m0 ``scale`` per tile
        ([ceil(R/br), ceil(C/bc)]), or packed MXFP4 int8 [R, C/2] (two e2m1 codes per byte, even column
        in the low nibble) with an e8m0 scale per 1 x 32 ([R, C/32]). Activations are first rounded to FP8
        with one power-of-two scale per ``1 x activation_block`` segment, as the release's kernels do.
        Returns [..., R] in ``x``'s dtype.
        """

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Each group's slice of ``x`` [T, G, C] times its rows of a quantized ``weight`` [G R, C] (``linear``'s
        formats): [T, G, R] in ``x``'s dtype, the activations NOT rounded (the release dequantizes this weight, V4's
        ``wo_a``, when it loads; ``deepinfer.runtime.ops.grouped_dequantized_linear``)."""

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``hidden W^T`` in fp32 for a float ``weight`` [V, C] kept in its own dtype: the vocabulary projection of
        a model whose release computes logits in fp32 from a bf16 head, without an fp32 copy of the head. ``hidden``
        [T, C] fp32; returns [T, V] fp32, each product exact (bf16 and fp16 values are exact in fp32)."""


class MHCBackend(Protocol):
    name: str
    graph_safe: bool

    def coefficients(self, logits: torch.Tensor, hc_mult: int, sinkhorn_iters: int, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sublayer's hyper-connection weights from its scaled and biased logits [T, (2 + n) n] fp32 (n = hc_mult).

        Returns ``pre = sigmoid(logits[:, :n]) + eps`` [T, n], ``post = 2 sigmoid(logits[:, n:2n])`` [T, n] and
        ``comb`` [T, n, n]: a row softmax of the last n*n logits plus eps, then ``sinkhorn_iters`` alternating
        column / row normalisations (the first column one included; ``deepinfer.runtime.ops.sinkhorn``), all fp32.
        """

    def weights(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_mult: int,
                sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sublayer's hyper-connection weights from the streams [T, n, D] it receives: what ``coefficients``
        returns (``hc_eps`` its eps) for the logits ``base + (flat @ fn.T) * rsqrt(mean(flat^2, -1) + norm_eps)
        * scales`` [T, (2 + n) n], where ``flat`` is ``streams.flatten(1)`` in fp32 and ``scales`` repeats ``scale``
        [3] over the n pre, n post and n*n comb logits. ``fn`` [(2 + n) n, n D] and ``base`` [(2 + n) n] are fp32
        (``deepinfer.runtime.ops.mhc_logits``).
        """

    def collapse(self, streams: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
        """A sublayer's input [T, D] from the streams [T, n, D]: ``sum_i pre[:, i] * streams[:, i]`` computed in
        fp32 and returned in the streams' dtype; with ``norm_weight`` [D] fp32, RMS-normalized (``eps``) and scaled
        by it, the sublayer's input norm (``deepinfer.runtime.ops.mhc_collapse``)."""

    def sublayer_input(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                       hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                       norm_weight: torch.Tensor | None = None, eps: float = 0.0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``weights`` then ``collapse`` with their ``pre``: (the sublayer's input [T, D], post, comb), how a V4
        sublayer enters (a backend may do both in fewer launches; ``pre`` need not be materialized)."""

    def single_pass_input(self, streams: torch.Tensor, previous_pre: torch.Tensor, fn: torch.Tensor,
                          base: torch.Tensor, scale: torch.Tensor, hc_mult: int, sinkhorn_iters: int, hc_eps: float,
                          norm_eps: float, norm_weight: torch.Tensor | None = None, eps: float = 0.0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``weights`` of the streams, and ``collapse`` of the same streams with ``previous_pre`` [T, n] (V4.1's
        single-pass mHC: a sublayer enters through the pre of the sublayer before it): (the sublayer's input
        [T, D], pre, post, comb). Both read the streams, so a backend may do them in one pass."""

    def expand(self, streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
               ) -> torch.Tensor:
        """The new streams [T, n, D]: ``post[:, o] * output + sum_i comb[:, i, o] * streams[:, i]`` computed in fp32
        and rounded once to the output's dtype (``deepinfer.runtime.ops.mhc_expand``)."""

    def engram_gate(self, streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """V4.1's Engram on the streams [T, n, D]: stream i plus ``value`` [T, D] times ``sigmoid(s sqrt|dot|)``, s
        the sign of ``dot``, the fp32 dot product of the RMS-normalized (``eps``) stream and ``key[:, i]`` [T, n, D]
        weighted by ``q_weight[i] * k_weight[i]`` ([n, D]) over sqrt(D); rounded once to the streams' dtype
        (``deepinfer.runtime.ops.engram_gate``)."""


@dataclass(slots=True)
class ExpertWeights:
    """Stacked routed-expert weights of one MoE layer (w1 = gate, w3 = up, w2 = down).

    Float weights have no scales. Quantized ones (FP8 or packed MXFP4, see ``LinearBackend``) carry their
    e8m0 scales with the same leading expert dim, and activations entering w1/w3 and w2 are rounded to FP8
    in ``1 x activation_block`` segments.
    """

    w1: torch.Tensor  # [E, I, hidden] (packed MXFP4: [E, I, hidden/2])
    w3: torch.Tensor  # [E, I, hidden]
    w2: torch.Tensor  # [E, hidden, I]
    swiglu_limit: float
    w1_scale: torch.Tensor | None = None
    w3_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    activation_block: int = 0


@dataclass(slots=True)
class RouterWeights:
    """One MoE layer's router. Scores are ``score(x W^T)`` per expert in fp32; a hash layer (``tid2eid`` given)
    takes its token's table row, a score-routed one (``bias`` given) the ``top_k`` best ``score + bias``."""

    weight: torch.Tensor  # [E, hidden] fp32
    bias: torch.Tensor | None  # [E] fp32: score-routed layers
    tid2eid: torch.Tensor | None  # [vocab, top_k] int: hash layers
    top_k: int
    scoring_func: str  # "sqrtsoftplus" (sqrt(softplus(l))), "softmax" (over the E experts) or "sigmoid"
    norm_topk_prob: bool  # the chosen scores divided by their sum (+1e-20)
    route_scale: float


class MoEBackend(Protocol):
    name: str
    graph_safe: bool

    def route(self, x: torch.Tensor, token_ids: torch.Tensor, router: RouterWeights
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights: ``ids`` [T, top_k] int64 and ``weights`` [T, top_k] fp32.

        ``x`` [T, hidden] (any float dtype, multiplied in fp32), ``token_ids`` [T] (read by hash layers). Score-routed
        ids are sorted by descending biased score; a hash layer's ids are its ``tid2eid`` row in that row's order.
        The weights are the unbiased scores of those ids, normalised if ``norm_topk_prob``, times ``route_scale``
        (``deepinfer.runtime.ops.route_tokens`` is the reference).
        """

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """The shared expert's activation: ``silu(min(gate, L)) * clamp(up, -L, L)`` in fp32, returned in ``gate``'s
        dtype (``deepinfer.runtime.ops.swiglu`` is the reference, before the cast)."""

    def routed_experts(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: ExpertWeights,
    ) -> torch.Tensor:
        """Sum over the k chosen experts of ``w * w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))``.

        ``x`` [T, hidden], ``topk_ids`` [T, k] int64, ``topk_weights`` [T, k] fp32.
        SwiGLU runs in fp32. Returns [T, hidden] in ``x``'s dtype.
        """


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters for the rows of a logits tensor [B, V].

    Rows with ``temperature == 0`` are greedy. ``top_k`` 0 means off, ``top_p`` 1.0 off,
    ``min_p`` 0.0 off. ``seeds`` is -1 for unseeded rows; seeded rows draw their noise from
    ``(seed, positions[row], token id)`` only (the engine gives each of a prompt's n samples its
    own seed). ``prompt_token_ids``/``output_token_ids`` feed the penalties. ``num_logprobs`` is the largest ``logprobs`` asked for in the batch (0 = none;
    the engine turns a request's -1, "whole vocabulary", into the vocabulary size).
    """

    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    presence_penalty: torch.Tensor  # [B] fp32
    frequency_penalty: torch.Tensor  # [B] fp32
    repetition_penalty: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, index of the token being sampled within its output
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    blocked_token_ids: list[list[int]]  # e.g. EOS before min_tokens
    num_logprobs: int
    all_greedy: bool
    any_penalties: bool
    # what the host already knows, so a sampler need not ask the device (a host sync) to skip work
    any_top_k_top_p: bool = True
    any_seeded: bool = True
    any_logprobs: bool = True  # False: no row records log-probabilities, so ``SamplerOutput.logprobs`` may be None
    # each row's {token id: bias} added to its logits before anything else (OpenAI's logit_bias); empty: no row has any
    logit_bias: list[dict[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # [B] fp32, log-probability of each sampled token (raw model distribution); None when no row asked for any
    # (``SamplingBatch.any_logprobs``): a softmax over the vocabulary costs a decode step at batch 1 tens of µs
    logprobs: torch.Tensor | None
    top_logprob_ids: torch.Tensor | None  # [B, num_logprobs] int64
    top_logprobs: torch.Tensor | None  # [B, num_logprobs] fp32


class Sampler(Protocol):
    name: str
    # ``sample`` may be captured in a CUDA graph for batches without penalties or blocked tokens (the only ones
    # the engine captures: overlapped speculative steps); without it, speculative steps wait for the host
    graph_safe: bool

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Apply penalties, temperature, top-k/top-p/min-p, then draw one token per row."""


@dataclass(slots=True)
class Draft:
    """Tokens proposed to follow a request's last token, and optionally, per position, the drafter's estimate of
    the probability that the target accepts that token given it accepted the ones before (DSpark's confidence
    head); the engine's confidence scheduling verifies the prefix whose survival (their running product) pays."""

    token_ids: list[int]
    confidence: list[float] | None = None


@dataclass(slots=True)
class ComputedRows:
    """A request's rows of the last forward pass whose results it keeps: ``count`` tokens from ``position``,
    starting at ``row`` of the step's token order (where the model's per-token outputs hold them). Rows computed
    for rejected drafts are left out."""

    request: object
    row: int
    position: int
    count: int


class Drafter(Protocol):
    name: str

    def propose(self, requests: list, computed: list[ComputedRows], features) -> list[Draft]:
        """One ``Draft`` per request (``runtime.request.Request``: its ``token_ids`` end with the token the drafts
        follow; none is pending a value). Called after each step, with what that step computed (``computed``'s
        rows index ``features``, the step's ``ModelOutput.features``, or None), for the requests that decode
        next (none, when a step only prefilled: ``computed`` still matters); an empty draft means no speculation
        for that request this step. Longer drafts than the engine verifies are cut."""

    # Optional: ``use_cuda_graphs(batch_sizes: list[int]) -> None``, called once when the engine replays decode
    # steps from CUDA graphs of these padded batch sizes, so a drafter may capture its own pass likewise.
    #
    # Optional, together: ``device_slots(requests) -> list[int]`` and ``propose_on_device(slots, positions, rows,
    # kept, sampled, features) -> (tokens [B, D], confidence [B, D] or None)``; speculative steps then overlap
    # the host (``engine/overlapped_speculation.py``). ``device_slots`` runs on the host: where each request's state lives
    # on the device. ``propose_on_device`` is device work only, captured in the engine's step graph (no host
    # reads, no tensors built from host values: it gets everything as arguments): the last step computed
    # ``rows`` rows per request from ``positions`` [B]; the first ``kept`` [B] of them stand; ``sampled`` [B,
    # rows] is the token after each row, so ``sampled[i, kept[i] - 1]`` is request i's new last token, the one
    # the drafts follow; ``features`` [B * rows, F] are the step's ``ModelOutput.features`` (or None). ``slots``
    # [B] are ``device_slots``' values, -1 for the graph's padding requests, whose outputs are ignored and whose
    # writes must not touch any request's state.
    #
    # Optional, with those two: ``store_on_device(slots, positions, sampled, features) -> None``, a plain step's
    # rows into the drafter's state without a draft pass: one row per request at ``positions`` [B], ``sampled``
    # [B] the token after each, ``features`` [B, F]. Device work only, like ``propose_on_device``: it is captured in
    # the plain step's graph (``engine/plain_store.py``) or queued behind its eager sampling; with it, the plain
    # steps the measured draft policy chooses overlap the host as decoding without drafts does.


class PrefillTruncation(Protocol):
    name: str

    def replay_start(self, num_prompt_tokens: int) -> int:
        """First prompt position the decoder layers must run on."""


class LogitsProcessor(Protocol):
    """Structured outputs: one ``GrammarMatcher`` per constrained request."""

    name: str

    def validate(self, so_args: dict) -> None:
        """Raise ``ValueError`` naming the problem if ``so_args`` cannot be enforced (before anything runs)."""

    def matcher(self, so_args: dict) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (``so_args`` validated)."""


class GrammarMatcher(Protocol):
    terminated: bool  # the grammar has ended: the request stops

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """The tokens the grammar allows next into ``bitmask[row]``: int32 words on the host, bit ``j`` of word
        ``i`` standing for token ``32 * i + j`` (xgrammar's layout); the row arrives all ones."""

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it (the state is then unchanged)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's drafts)."""


@dataclass(slots=True)
class Dispatched:
    """One expert-parallel MoE layer's work on this rank, and what ``TokenExchange.combine`` needs to return it."""

    rows: torch.Tensor  # [N, hidden] the activations of the (token, choice) pairs routed to this rank's experts
    slots: torch.Tensor  # [N] int64 the local expert slot of each row
    weights: torch.Tensor  # [N] fp32 each row's routing weight
    handle: object  # the exchange's own bookkeeping


class TokenExchange(Protocol):
    name: str

    def dispatch(self, x: torch.Tensor, physical: torch.Tensor, weights: torch.Tensor,
                 slots_per_rank: int) -> Dispatched:
        """Send every (token, choice) pair of this rank's ``x`` [T, hidden] to the rank holding its physical expert
        slot ``physical`` [T, k] (slot p lives on rank p // slots_per_rank, as local slot p % slots_per_rank), with
        its weight from ``weights`` [T, k]; return the pairs this rank computes."""

    def combine(self, computed: torch.Tensor, dispatched: Dispatched, num_tokens: int) -> torch.Tensor:
        """Send each computed row [N, hidden] (weighted already) back to its token's rank; return this rank's
        [num_tokens, hidden] sums over each token's choices (in fp32, rounded once to ``computed``'s dtype)."""

