"""The Ascend backend's token exchange for expert parallelism (``deepinfer_ascend.exchange``) on a CPU.

``npu_moe_distribute_dispatch_v2``/``combine_v2`` are rendered for W ranks in one process (a thread per rank) from
their op-plugin docs, asserting the inputs the docs require, so ``AscendExchange``'s own code runs on every rank
between them; the MoE output equals the single-process reference's. This proves the conversions, not the NPU's
kernels nor HCCL: ``tools/validation/ascend_validate.py`` runs the operators on two NPUs.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends" / "ascend"))  # when not pip-installed

from deepinfer import envs  # noqa: E402
from deepinfer.engine.config import EngineConfig  # noqa: E402
from deepinfer.plugins.builtin.torch_moe import TorchMoE  # noqa: E402
from deepinfer.plugins.interfaces import Dispatched, ExpertWeights  # noqa: E402
from deepinfer_ascend import plugin  # noqa: E402
from deepinfer.testing.backend_fixtures import random_experts, stand_in_ranks  # noqa: E402
from deepinfer_ascend.exchange import AscendExchange, buffer_bytes, call_inputs, chunk_tokens  # noqa: E402

CPU = torch.device("cpu")
NPU_LIKE = SimpleNamespace(type="npu")  # what torch.device("npu") is once torch_npu is imported; unbuildable here


def test_token_exchange_declines_on_a_cpu_without_torch_npu_its_operators_or_in_batch_invariant_mode(monkeypatch):
    assert plugin.deepinfer_token_exchange(config=None, ranks=stand_in_ranks(CPU)) is None
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert plugin.deepinfer_token_exchange(config=EngineConfig(), ranks=stand_in_ranks(NPU_LIKE)) is None
    monkeypatch.setattr(plugin.npu, "torch_npu", lambda: SimpleNamespace())  # a torch_npu without the MC2 operators
    assert plugin.deepinfer_token_exchange(config=EngineConfig(), ranks=stand_in_ranks(NPU_LIKE)) is None
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    envs.reload()
    assert plugin.deepinfer_token_exchange(config=EngineConfig(), ranks=stand_in_ranks(NPU_LIKE)) is None


# --- expert parallelism's token exchange ---------------------------------------------------------------------------
# What this proves: AscendExchange's arguments, its reading of the outputs (rows, local slots), the weights applied
# once, the chunking and the zero token, against the operators' DOCUMENTED semantics. Not the NPU's kernels, nor
# HCCL: tools/validation/ascend_validate.py runs the operators on two NPUs.

class DocumentedMoeDistribute:
    """npu_moe_distribute_dispatch_v2 / combine_v2 for ``world`` ranks in one process, each rank a thread: a call waits
    until every rank made it (a collective), then returns this rank's outputs, and asserts the doc's input rules.

    dispatch: expand_x [A, H], A = global_bs * min(local experts, K): the (token, choice) pairs routed to this rank's
    experts, grouped by local expert in order (op-plugin's golden), in random order inside a group (undocumented),
    NaN after them; expert_token_nums, the counts. assist_info_for_combine, ep_recv_counts and expand_scales hold
    this stand-in's own bookkeeping (NaN scales): their contents are undocumented, they must come back unread.
    combine: out[t] = sum_j expert_scales[t, j] * (the returned row of choice j), in fp32, in expand_x's dtype.
    """

    def __init__(self, world):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.inbox = [None] * world
        self.sent = [[] for _ in range(world)]  # each rank's dispatch outputs not yet combined, in call order

    def _everyone(self, rank, item):
        self.inbox[rank] = item
        self.barrier.wait()
        items = list(self.inbox)
        self.barrier.wait()  # nobody refills the inbox before everyone has read it
        return items

    def agree(self, rank):
        return lambda values: [max(column) for column in zip(*self._everyone(rank, list(values)))]

    def npu_moe_distribute_dispatch_v2(self, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                       shared_expert_rank_num, quant_mode, global_bs, expert_token_nums_type):
        (bs, hidden), k = x.shape, expert_ids.shape[1]
        assert x.dtype in (torch.bfloat16, torch.float16) and expert_ids.dtype == torch.int32
        assert 0 < bs and expert_ids.shape[0] == bs and 1024 <= hidden <= 7168 and hidden % 32 == 0
        assert 0 < k <= min(16, moe_expert_num) and 0 < moe_expert_num <= 1024 and moe_expert_num % ep_world_size == 0
        assert all(0 <= e < moe_expert_num for e in expert_ids.flatten().tolist())
        assert all(len(set(row)) == k for row in expert_ids.tolist()), "a row's K ids must differ"
        assert (shared_expert_rank_num, quant_mode, expert_token_nums_type) == (0, 0, 1) and ep_world_size == self.world
        assert isinstance(group_ep, str) and 1 <= len(group_ep) < 128
        everyone = self._everyone(ep_rank_id, (x, expert_ids, (group_ep, moe_expert_num, global_bs)))
        assert len({shared for _, _, shared in everyone}) == 1, "group_ep, moe_expert_num, global_bs must agree"
        assert global_bs >= max(xs.shape[0] for xs, _, _ in everyone) * ep_world_size  # max_bs * ep_world_size
        local = moe_expert_num // ep_world_size
        pairs = [(e % local, source, t, j) for source, (_, ids, _) in enumerate(everyone)
                 for t, row in enumerate(ids.tolist()) for j, e in enumerate(row) if e // local == ep_rank_id]
        shuffle = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(len(pairs) + ep_rank_id))
        pairs = sorted((pairs[i] for i in shuffle.tolist()), key=lambda pair: pair[0])  # stable: random in a group
        capacity = global_bs * min(local, k)
        expand_x = torch.full((capacity, hidden), float("nan"), dtype=x.dtype)
        assist = torch.full((capacity, 128), -1, dtype=torch.int32)
        for row, (_, source, t, j) in enumerate(pairs):
            expand_x[row] = everyone[source][0][t]
            assist[row, :3] = torch.tensor([source, t, j])
        counts = torch.bincount(torch.tensor([p[0] for p in pairs], dtype=torch.long), minlength=local)
        per_source = torch.zeros(local, ep_world_size, dtype=torch.int32)
        for e, source, _, _ in pairs:
            per_source[e, source] += 1
        out = (expand_x, None, assist.flatten(), counts, per_source.flatten().cumsum(0).int(),
               torch.empty(0, dtype=torch.int32), torch.full((capacity,), float("nan")))
        self.sent[ep_rank_id].append((expert_ids, out))
        return out

    def npu_moe_distribute_combine_v2(self, expand_x, expert_ids, assist_info_for_combine, ep_send_counts,
                                      expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, expand_scales,
                                      shared_expert_rank_num, global_bs):
        sent_ids, sent = self.sent[ep_rank_id].pop(0)
        assert expert_ids is sent_ids and assist_info_for_combine is sent[2] and ep_send_counts is sent[4]
        assert expand_scales is sent[6] and expand_x.shape == sent[0].shape and expand_x.dtype == sent[0].dtype
        assert expert_scales.dtype == torch.float32 and expert_scales.shape == expert_ids.shape
        assert shared_expert_rank_num == 0 and ep_world_size == self.world and isinstance(group_ep, str)
        everyone = self._everyone(ep_rank_id, (expand_x, assist_info_for_combine))
        out = torch.zeros(expert_ids.shape[0], expand_x.shape[1])
        for rows, assist in everyone:
            for row, (source, t, j) in enumerate(assist.view(-1, 128)[:, :3].tolist()):
                if source == ep_rank_id:
                    out[t] += expert_scales[t, j] * rows[row].float()
        return out.to(expand_x.dtype)


def _on_every_rank(sim, work):
    """``work(rank)`` in one thread per rank; the first error (a stuck collective aborts the others) is raised."""
    results, errors = [None] * sim.world, []

    def run(rank):
        try:
            results[rank] = work(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)
            sim.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(sim.world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


def _ep_routing(g, tokens, k, phy2log, per_rank, cold):
    """Physical slots [tokens, k] with k distinct logical experts, none on rank ``cold``, and weights."""
    rows = []
    for _ in range(tokens):
        row, used = [], set()
        for slot in torch.randperm(len(phy2log), generator=g).tolist():
            if slot // per_rank != cold and phy2log[slot] not in used and len(row) < k:
                row.append(slot)
                used.add(phy2log[slot])
        rows.append(row)
    physical = torch.tensor(rows, dtype=torch.long).view(tokens, k)
    return physical, torch.rand(tokens, k, generator=g) * 0.9 + 0.1


# (ranks, tokens per rank, a rank no token chooses, tokens per rank and call): one call in which rank 1 receives
# nothing (the caller skips its experts); several calls, with zero tokens sent by a rank that has none left or none
# at all; no tokens anywhere (no call).
@pytest.mark.parametrize("world,tokens,cold,most", [(2, [3, 4], 1, 4), (4, [5, 9, 0, 3], 2, 4), (2, [0, 0], None, 4)])
def test_token_exchange_conversions_give_the_reference_moe(world, tokens, cold, most):
    g = torch.Generator().manual_seed(world + sum(tokens))
    k, experts, hidden = 3, 6, 1024
    phy2log = list(range(experts)) + [0, 1]  # two redundant slots: copies of experts 0 and 1
    per_rank = len(phy2log) // world
    every = random_experts(g, torch.bfloat16, experts=experts, hidden=hidden, inter=16)
    inputs = [((torch.randn(n, hidden, generator=g) * 3).bfloat16(), *_ep_routing(g, n, k, phy2log, per_rank, cold))
              for n in tokens]
    sim = DocumentedMoeDistribute(world)

    def rank_work(rank):
        x, physical, weights = inputs[rank]
        held = torch.tensor(phy2log[rank * per_rank:(rank + 1) * per_rank])
        mine = ExpertWeights(every.w1[held], every.w3[held], every.w2[held], every.swiglu_limit)
        exchange = AscendExchange(sim, "simulated-ep-group", rank, world, sim.agree(rank), None, buffer_mb=1 << 20,
                                  most=most)
        work = exchange.dispatch(x, physical, weights, per_rank)
        # weights are applied once, by the combine (expert_scales): the backend's are ones
        assert torch.equal(work.weights, torch.ones(work.rows.shape[0]))
        assert not work.rows.isnan().any() and work.slots.dtype == torch.long
        if work.rows.shape[0]:  # as ExpertParallel.routed_experts calls the backend
            computed = TorchMoE().routed_experts(work.rows, work.slots.unsqueeze(1), work.weights.unsqueeze(1), mine)
        else:
            computed = work.rows
        return work.rows.shape[0], exchange.combine(computed, work, x.shape[0])

    results = _on_every_rank(sim, rank_work)
    if cold is not None and max(tokens) <= most:  # one call, no zero tokens: nothing reaches the cold rank
        assert results[cold][0] == 0
    for (x, physical, weights), (_, ours) in zip(inputs, results):
        logical = torch.tensor(phy2log)[physical]
        reference = TorchMoE().routed_experts(x, logical, weights, every).float()
        twice = TorchMoE().routed_experts(x, logical, weights * weights, every).float()  # weights applied twice
        assert ours.shape == x.shape and ours.dtype == torch.bfloat16
        # bf16 rows rounded before the combine sums them, the reference rounds once: within 1%
        assert (ours.float() - reference).norm() <= 1e-2 * reference.norm()
        assert x.shape[0] == 0 or (twice - reference).norm() > 0.2 * reference.norm()  # which this test would see


def test_token_exchange_falls_back_on_every_rank_when_any_row_repeats_a_slot():
    sim = DocumentedMoeDistribute(2)
    served = []

    class Fallback:
        def dispatch(self, x, physical, weights, slots_per_rank):
            served.append(x.shape[0])
            return Dispatched(x, physical[:, 0], weights[:, 0], "fallback")

        def combine(self, computed, dispatched, num_tokens):
            assert dispatched.handle == "fallback"
            return computed

    def rank_work(rank):
        physical = torch.tensor([[0, 1], [2, 3]]) if rank == 0 else torch.tensor([[1, 1]])  # rank 1 repeats
        x = torch.zeros(physical.shape[0], 1024, dtype=torch.bfloat16)
        exchange = AscendExchange(None, "g", rank, 2, sim.agree(rank), Fallback(), buffer_mb=1 << 20)
        work = exchange.dispatch(x, physical, torch.ones(physical.shape), 2)
        return exchange.combine(work.rows, work, x.shape[0]).shape

    assert _on_every_rank(sim, rank_work) == [(2, 1024), (1, 1024)] and sorted(served) == [1, 2]


@pytest.mark.parametrize("dtype,hidden,world,k", [(torch.float32, 1024, 2, 2), (torch.bfloat16, 64, 2, 2),
                                                  (torch.bfloat16, 1024, 9, 2), (torch.bfloat16, 1024, 2, 17)])
def test_token_exchange_outside_the_documented_limits_goes_to_the_fallback(dtype, hidden, world, k):
    handle = object()
    fallback = SimpleNamespace(dispatch=lambda *args: Dispatched(args[0], args[1][:, 0], args[2][:, 0], handle),
                               combine=lambda computed, dispatched, n: ("fallback", dispatched.handle))
    exchange = AscendExchange(None, "g", 0, world, None, fallback)  # None: no operator, no agreement may run
    x, physical = torch.zeros(3, hidden, dtype=dtype), torch.arange(k).repeat(3, 1)
    work = exchange.dispatch(x, physical, torch.ones(3, k), 32)
    assert exchange.combine(work.rows, work, 3) == ("fallback", handle)


def test_calls_fit_the_documented_hccl_buffer_and_the_zero_token_is_harmless():
    # V4-Flash over 8 ranks: 256 experts (32 per rank), k 6, hidden 4096, HCCL_BUFFSIZE's default 200 MB
    bs = chunk_tokens(4096, 6, 32, 8, 200)
    assert 0 < bs < 256 and buffer_bytes(bs, 4096, 6, 32, 8) <= 200 << 20 < buffer_bytes(2 * bs, 4096, 6, 32, 8)
    assert chunk_tokens(4096, 6, 32, 8, 4096) == 256 and chunk_tokens(4096, 6, 32, 8, 1) == 0
    x, physical, weights = torch.zeros(0, 1024), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3)
    piece, ids, scales, real = call_inputs(x, physical, weights, 0, 0, rank=3, slots_per_rank=2, world=4)
    assert real == 0 and piece.shape == (1, 1024) and not piece.any() and not scales.any()
    assert ids.dtype == torch.int32 and ids.tolist() == [[6, 7, 0]]  # this rank's own slots first, distinct


def test_token_exchange_hook_serves_an_npu_on_a_group_of_its_own(monkeypatch):
    """torch_npu with the MC2 operators (here a stand-in): the hook makes the operators' own HCCL group and names it
    the documented way, with the rank's device made current first."""
    calls = []
    backend = SimpleNamespace(get_hccl_comm_name=lambda rank: calls.append(("name", rank)) or f"hccl-group-{rank}")
    group = SimpleNamespace(_get_backend=lambda device: calls.append(("backend", str(device))) or backend)
    module = SimpleNamespace(npu=SimpleNamespace(set_device=lambda device: calls.append(("device", device))),
                             npu_moe_distribute_dispatch_v2=None, npu_moe_distribute_combine_v2=None)
    monkeypatch.setattr(plugin.npu, "torch_npu", lambda: module)
    monkeypatch.setattr("torch.distributed.new_group", lambda **kw: calls.append(("new_group", kw)) or group)
    monkeypatch.setattr(torch, "device", lambda name: SimpleNamespace(type=name), raising=True)
    ranks = SimpleNamespace(rank=1, world_size=2, device=NPU_LIKE, device_group="world", control_group="gloo")
    exchange = plugin.deepinfer_token_exchange(config=EngineConfig(), ranks=ranks)
    monkeypatch.undo()
    assert isinstance(exchange, AscendExchange) and exchange.ops is module
    assert (exchange.group, exchange.rank, exchange.world) == ("hccl-group-1", 1, 2)
    assert calls[:2] == [("device", NPU_LIKE), ("new_group", {"backend": "hccl"})] and calls[-1] == ("name", 1)
    assert exchange.fallback.group == "world" and exchange.fallback.world_size == 2
