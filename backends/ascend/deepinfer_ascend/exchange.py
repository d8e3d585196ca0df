"""Expert parallelism's token exchange on torch_npu: ``npu_moe_distribute_dispatch_v2`` and
``npu_moe_distribute_combine_v2`` (MC2: the exchange runs inside the operators, over HCCL).

Sources, besides those ``npu.py`` lists: op-plugin's ``torch_npu-npu_moe_distribute_{dispatch,combine}_v2.md``, their
tests ``test/test_custom_ops/test_moe_distribute_{dispatch,combine}_v2.py`` and, for the group name,
``docs/zh/custom_APIs/distributed/torch-distributed-distributed_c10d.md`` (commit 517f2e7); the keywords are those of
its registered schemas (``op_plugin/config/op_plugin_functions.yaml``). The docs list A2/A3 only; op-plugin's tests
also run dispatch_v2 and combine_v2 on the Ascend 950 (bf16, H 4096, 8 ranks).

How our ``TokenExchange`` maps onto them:

* Expert ids are our physical slots (int32): the operator puts MoE expert p on rank p // (moe_expert_num /
  ep_world_size), which is our placement with ``moe_expert_num`` = every physical slot and no shared-expert ranks
  (``shared_expert_rank_num=0``). No TP domain, no quantization (``quant_mode=0``: rows travel in bf16/fp16),
  per-expert counts (``expert_token_nums_type=1``), the default communication algorithm (``comm_alg=""``).
* ``expand_x``'s first sum(``expert_token_nums``) rows are this rank's work, grouped by local expert in order
  (op-plugin's golden); a row's local slot is the index of its group. The order inside a group is undocumented and
  nothing here reads it: ``assist_info_for_combine``, ``ep_recv_counts`` and ``expand_scales`` are kept unread and
  handed to the combine as they came (the docs say so; their contents differ between products and versions).
* Weights, applied once: the combine computes ``sum_j expert_scales[t, j] * row(t, j)`` (its formula and golden),
  and the MoE backend multiplies each row by ``Dispatched.weights``. So the routing weights go to the combine as
  ``expert_scales`` and ``Dispatched.weights`` are ones (the backend's product by 1.0 is exact). The dispatch gets
  no ``expert_scales`` (A3's default algorithm takes none).
* Rows come back in the activations' dtype: each row is rounded once before the combine weights and sums it (the
  reference rounds the weighted sum once); the combine's accumulation precision is not documented.

Calls the operators cannot take (documented limits, ``exchange_unsupported``) go to the torch all-to-all: the
decision depends only on shapes and dtypes that every rank shares, so all ranks take the same path. Each call
moves at most ``chunk`` tokens per rank (the documented BS limit, lowered until HCCL_BUFFSIZE holds the documented
buffer), so ranks first agree on the largest token count and on whether any row repeats a slot (the operator needs
k distinct ids per row; then everyone falls back), on the host-side control group; every rank makes the same number
of calls, and one without tokens in a call sends a zero token with zero weights (BS must be > 0, and a
mask is not allowed when ranks' BS differ). The operators must own their HCCL group: ``for_ranks`` creates one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.logger import init_logger, log_once
from deepinfer.plugins.interfaces import Dispatched

logger = init_logger(__name__)

# The documented limits every listed product accepts (A2 "fullmesh", A3 default): bf16/fp16 tokens, hidden size a
# multiple of 32 in [1024, 7168], 0 < k <= 16, at most 1024 experts, BS <= 256 tokens per rank and call, and the
# EP world sizes A2 lists (A3 takes 2..768).
DTYPES = (torch.bfloat16, torch.float16)
MIN_HIDDEN, MAX_HIDDEN, HIDDEN_ALIGN = 1024, 7168, 32
MAX_K, MAX_EXPERTS, MAX_BS = 16, 1024, 256
WORLD_SIZES = (2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256)
DEFAULT_BUFFER_MB = 200  # HCCL_BUFFSIZE when unset
_MB = 1 << 20


def exchange_unsupported(x: torch.Tensor, physical: torch.Tensor, slots_per_rank: int, world: int) -> str | None:
    """Why the operators cannot take this call, or None."""
    hidden, k, experts = x.shape[1], physical.shape[1], slots_per_rank * world
    if world not in WORLD_SIZES:
        return f"{world} ranks (the documented EP world sizes are {WORLD_SIZES})"
    if x.dtype not in DTYPES:
        return f"{x.dtype} activations (the operators move bf16/fp16)"
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN or hidden % HIDDEN_ALIGN:
        return f"hidden size {hidden} (documented: a multiple of {HIDDEN_ALIGN} in [{MIN_HIDDEN}, {MAX_HIDDEN}])"
    if not 0 < k <= min(MAX_K, experts):
        return f"k={k} (documented: 0 < k <= {MAX_K} and k <= moe_expert_num)"
    if experts > MAX_EXPERTS:
        return f"{experts} expert slots (documented: at most {MAX_EXPERTS})"
    return None


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def buffer_bytes(bs: int, hidden: int, k: int, local: int, world: int) -> int:
    """The larger of the documented HCCL buffer needs: A2 "fullmesh" and A3's default, with the default single
    shared expert counted (no shared-expert ranks, so it moves nothing)."""
    a2 = 2 * (bs * world * min(local, k) * hidden * 2 + 2 * _MB)
    a3 = 2 * (local * bs * world * _align(_align(2 * hidden, 32) + 64, 512) + (k + 1) * bs * _align(2 * hidden, 512))
    return max(a2, a3)


def chunk_tokens(hidden: int, k: int, local: int, world: int, buffer_mb: int, most: int = MAX_BS) -> int:
    """Tokens per rank and call: ``most``, halved until the documented buffer fits ``buffer_mb``; 0 if none does."""
    bs = most
    while bs and buffer_bytes(bs, hidden, k, local, world) > buffer_mb * _MB:
        bs //= 2
    return bs


def call_inputs(x: torch.Tensor, physical: torch.Tensor, weights: torch.Tensor, start: int, stop: int, rank: int,
                slots_per_rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One call's ``(x, expert_ids int32, expert_scales fp32, real tokens)`` for tokens [start, stop). With none, a
    zero token to k distinct slots (this rank's own first) with zero weights: the operator needs BS > 0."""
    if stop > start:
        return x[start:stop], physical[start:stop].to(torch.int32), weights[start:stop].float(), stop - start
    k = physical.shape[1]
    ids = (rank * slots_per_rank + torch.arange(k, device=x.device)) % (slots_per_rank * world)
    return x.new_zeros(1, x.shape[1]), ids.to(torch.int32).unsqueeze(0), weights.new_zeros(1, k, dtype=torch.float32), 0


def dispatch_arguments(x: torch.Tensor, expert_ids: torch.Tensor, group: str, rank: int, world: int, experts: int,
                       global_bs: int) -> tuple[tuple, dict]:
    """npu_moe_distribute_dispatch_v2: no quantization, no shared-expert ranks, counts per local expert, the default
    algorithm and TP arguments. ``global_bs`` = tokens per rank and call x ranks: the same on every rank and layer,
    and at least the largest BS times ep_world_size, as the doc asks when ranks' BS differ."""
    return (x.contiguous(), expert_ids.contiguous(), group, world, rank, experts), dict(
        shared_expert_rank_num=0, quant_mode=0, global_bs=global_bs, expert_token_nums_type=1)


def received(expand_x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows this rank computes (``expand_x``'s first sum(counts)) and each one's local slot: rows come grouped by
    local expert, ``counts[e]`` rows for expert e."""
    slots = torch.repeat_interleave(torch.arange(len(counts), device=expand_x.device),
                                    torch.tensor(counts, device=expand_x.device))
    return expand_x[:sum(counts)], slots


@dataclass(slots=True)
class _Call:
    """One dispatch_v2 call, as its combine_v2 needs it."""
    tokens: int  # this rank's real tokens in the call (0: the zero token was sent)
    rows: int  # rows received: sum of expert_token_nums
    capacity: int  # A: expand_x's rows
    expert_ids: torch.Tensor
    expert_scales: torch.Tensor
    assist_info: torch.Tensor  # the next three go back unread
    ep_recv_counts: torch.Tensor
    expand_scales: torch.Tensor | None


@dataclass(slots=True)
class _Handle:
    calls: list[_Call]
    experts: int  # moe_expert_num: every physical slot
    global_bs: int


def combine_arguments(computed: torch.Tensor, call: _Call, group: str, rank: int, world: int, experts: int,
                      global_bs: int) -> tuple[tuple, dict]:
    """npu_moe_distribute_combine_v2 for one call: the computed rows (already multiplied by Dispatched.weights,
    ones) padded with zeros to A rows; the routing weights as ``expert_scales``, which the combine applies."""
    rows = computed.new_zeros(call.capacity, computed.shape[1])
    rows[:call.rows] = computed
    args = (rows, call.expert_ids, call.assist_info, call.ep_recv_counts, call.expert_scales, group, world, rank,
            experts)
    return args, dict(expand_scales=call.expand_scales, shared_expert_rank_num=0, global_bs=global_bs)


class AscendExchange:
    """``TokenExchange`` on torch_npu's MC2 operators. ``ops`` is the torch_npu module, ``group`` the HCCL name of a
    group that only these operators use, ``agree`` the elementwise max of a list of ints over the ranks, and
    ``fallback`` the exchange that serves calls outside the operators' limits."""

    name = "ascend-moe-distribute"

    def __init__(self, ops, group: str, rank: int, world: int, agree, fallback, buffer_mb: int | None = None,
                 most: int = MAX_BS):
        self.ops, self.group, self.rank, self.world = ops, group, rank, world
        self.agree, self.fallback, self.most = agree, fallback, most
        self.buffer_mb = int(os.environ.get("HCCL_BUFFSIZE", DEFAULT_BUFFER_MB)) if buffer_mb is None else buffer_mb
        self._chunks: dict[tuple[int, int, int], int] = {}

    @classmethod
    def for_ranks(cls, ops, ranks, most: int = MAX_BS) -> "AscendExchange":
        """The operators' own HCCL group over every rank (their docs: no other operator may use it); its name from
        ``group._get_backend(npu).get_hccl_comm_name(global rank)``, with the rank's device current, as documented.
        Every rank calls this, at the same point (the hook), as ``new_group`` needs."""
        from deepinfer.plugins.builtin.torch_exchange import AllToAllExchange

        ops.npu.set_device(ranks.device)
        group = dist.new_group(backend="hccl")
        name = group._get_backend(torch.device("npu")).get_hccl_comm_name(ranks.rank)
        control = ranks.control_group

        def agree(values: list[int]) -> list[int]:
            flags = torch.tensor(values, dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control)
            return flags.tolist()

        fallback = AllToAllExchange(ranks.device_group, ranks.world_size)
        return cls(ops, name, ranks.rank, ranks.world_size, agree, fallback, most=most)

    def chunk(self, hidden: int, k: int, local: int) -> int:
        key = (hidden, k, local)
        if key not in self._chunks:
            self._chunks[key] = chunk_tokens(hidden, k, local, self.world, self.buffer_mb, self.most)
            need = buffer_bytes(self.most, hidden, k, local, self.world)
            logger.info("Ascend token exchange: %d tokens per rank and call (HCCL_BUFFSIZE %d MB; %d tokens would need "
                        "%d MB)", self._chunks[key], self.buffer_mb, self.most, -(-need // _MB))
        return self._chunks[key]

    def dispatch(self, x, physical, weights, slots_per_rank):
        tokens, (hidden, k) = x.shape[0], (x.shape[1], physical.shape[1])
        reason = exchange_unsupported(x, physical, slots_per_rank, self.world)
        chunk = 0 if reason else self.chunk(hidden, k, slots_per_rank)
        if reason is None and chunk == 0:
            reason = f"HCCL_BUFFSIZE={self.buffer_mb} MB is below the documented need of even one token per call"
        if reason is None:
            ordered = physical.sort(dim=1).values
            repeats = int((ordered[:, 1:] == ordered[:, :-1]).any()) if tokens else 0
            most, repeats = self.agree([tokens, repeats])
            if repeats:
                reason = "a token's k expert slots repeat (the operators need distinct ids in a row)"
        if reason is not None:
            log_once(logger, logging.WARNING, f"Ascend token exchange: {reason}; the torch all-to-all serves it")
            return self.fallback.dispatch(x, physical, weights, slots_per_rank)
        experts, global_bs = slots_per_rank * self.world, chunk * self.world
        calls, rows, slots = [], [], []
        for start in range(0, most, chunk):
            piece, ids, scales, real = call_inputs(x, physical, weights, start, min(start + chunk, tokens), self.rank,
                                                   slots_per_rank, self.world)
            args, kwargs = dispatch_arguments(piece, ids, self.group, self.rank, self.world, experts, global_bs)
            expand_x, _, assist, counts, ep_counts, _, expand_scales = self.ops.npu_moe_distribute_dispatch_v2(
                *args, **kwargs)
            counts = counts.tolist()  # host: the rows' count sizes the output
            got, local = received(expand_x, counts)
            # more than one call: copy the rows out so each call's A-row buffer is freed now
            rows.append(got if most <= chunk else got.clone())
            slots.append(local)
            calls.append(_Call(real, got.shape[0], expand_x.shape[0], ids, scales, assist, ep_counts, expand_scales))
        if not calls:  # no rank has tokens: no call at all
            return Dispatched(x[:0], physical.new_zeros(0), weights.new_zeros(0, dtype=torch.float32),
                              _Handle([], experts, global_bs))
        rows = rows[0] if len(rows) == 1 else torch.cat(rows)
        slots = torch.cat(slots)
        # the combine applies the routing weights (expert_scales): the backend's must be ones
        return Dispatched(rows, slots, torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device),
                          _Handle(calls, experts, global_bs))

    def combine(self, computed, dispatched, num_tokens):
        handle = dispatched.handle
        if not isinstance(handle, _Handle):
            return self.fallback.combine(computed, dispatched, num_tokens)
        outs, start = [], 0
        for call in handle.calls:
            args, kwargs = combine_arguments(computed[start:start + call.rows], call, self.group, self.rank,
                                             self.world, handle.experts, handle.global_bs)
            start += call.rows
            outs.append(self.ops.npu_moe_distribute_combine_v2(*args, **kwargs)[:call.tokens])
        if not outs:
            return computed.new_zeros(num_tokens, computed.shape[1])
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        assert out.shape[0] == num_tokens, (out.shape, num_tokens)
        return out
