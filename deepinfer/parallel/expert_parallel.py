"""Expert parallelism: the routed experts' weights are spread over the ranks.

Each MoE layer sends every (token, chosen expert) pair to the rank that holds a copy of that expert (the
``deepinfer_token_exchange`` plugin's ``TokenExchange``; built in: ``all_to_all_single``), that rank runs its local
experts through the MoE backend, and the weighted results come back to be summed per token. Ranks must run every step together (an idle rank runs the exchanges with no tokens of its
own), so the engine's steps are agreed with ``Ranks.any``. The split sizes of an exchange are read on the host,
so a step with expert parallelism cannot replay a CUDA graph.

With EPLB the placement follows measured load: every ``eplb_step_interval`` steps the ranks sum their per-expert
counts, compute the same new placement (``deepinfer.parallel.eplb``) and start moving the weights that change
place with asynchronous point-to-point transfers into spare buffers; generation goes on with the old placement
for one more step, then every rank swaps to the new one at the same step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.logger import init_logger
from deepinfer.parallel.eplb import ExpertLoad, ExpertPlacement, rebalance
from deepinfer.parallel.ranks import Ranks
from deepinfer.plugins.interfaces import ExpertWeights, TokenExchange
from deepinfer.plugins.manager import checked, select_backend

logger = init_logger(__name__)

_STACKS = ("w1", "w3", "w2")
# a new placement must cut the max/mean rank load by more than 1% to be worth moving weights for
_WORTH_MOVING = 0.99


@dataclass(slots=True)
class _Move:
    """EPLB weight moves under way: received copies land in ``staged`` and replace the old ones at ``swap``."""
    placement: ExpertPlacement
    works: list
    staged: list[tuple[torch.Tensor, int, torch.Tensor]]  # (stack tensor, local slot, its new contents)


@dataclass(slots=True)
class Balancedness:
    """Max over mean rank load (1.0 is perfect) of one EPLB window's measured load, under three placements."""
    static: float  # experts split evenly in order, no replicas: expert parallelism without EPLB
    in_force: float  # the placement that served the window (fitted on the window before: out of sample)
    refitted: float  # the new placement, fitted on this window's load (in sample)


class ExpertParallel:
    def __init__(self, ranks: Ranks, exchange: TokenExchange, num_layers: int, num_experts: int, *,
                 num_redundant: int = 0, eplb: bool = False, step_interval: int = 256, num_groups: int = 1):
        world = ranks.world_size
        physical = num_experts + num_redundant
        if physical % world:
            raise ValueError(f"expert parallelism over {world} ranks needs the {num_experts} experts plus "
                             f"num_redundant_experts={num_redundant} to divide evenly by {world}")
        self.ranks, self.exchange = ranks, exchange
        self.num_layers, self.num_experts, self.num_physical = num_layers, num_experts, physical
        self.num_groups = num_groups if num_groups and num_experts % num_groups == 0 else 1
        if num_redundant:  # before any load is measured the replicas go to experts in order
            placement = self._placement(torch.ones(num_layers, num_experts))
        else:
            placement = ExpertPlacement.identity(num_layers, num_experts, world)
        self.placement = placement.to(ranks.device)
        self.load = ExpertLoad(num_layers, num_experts, ranks.device) if eplb else None
        self.step_interval = step_interval
        self.steps = 0
        self.swaps = 0  # placements swapped in
        self.exchange_time = ExchangeTimer(ranks.device)
        self.balancedness: list[Balancedness] = []  # one per rebalance
        self._moe_layers: list = []
        self._move: _Move | None = None

    @classmethod
    def for_engine(cls, config, model_config, ranks: Ranks | None) -> "ExpertParallel | None":
        """The engine's expert parallelism, when ``enable_expert_parallel`` asks for it."""
        if not config.enable_expert_parallel:
            return None
        if ranks is None or ranks.world_size == 1:
            raise ValueError("enable_expert_parallel=True needs more than one rank: set data_parallel_size (the "
                             "experts are spread over the data-parallel ranks)")
        exchange, _ = checked("deepinfer_token_exchange",
                              select_backend("deepinfer_token_exchange", config=config, ranks=ranks))
        experts = model_config.n_routed_experts
        ep = cls(ranks, exchange, model_config.num_layers, experts, num_redundant=config.num_redundant_experts,
                 eplb=config.enable_eplb, step_interval=config.eplb_step_interval)
        logger.info("expert parallelism: %d experts per layer over %d ranks, %d slots each%s", experts,
                    ranks.world_size, ep.placement.slots_per_rank,
                    f", EPLB every {config.eplb_step_interval} steps" if config.enable_eplb else "")
        return ep

    # -- weights ------------------------------------------------------------------------------
    def held_experts(self, layer: int) -> list[int]:
        """The logical expert in each of this rank's slots of ``layer``."""
        return self.placement.local_experts(layer, self.ranks.rank)

    def attach(self, moe_layers: list) -> None:
        """The model's MoE layers, in the order a forward pass runs them (they call ``routed_experts``)."""
        if len(moe_layers) != self.num_layers:
            raise ValueError(f"expert parallelism planned {self.num_layers} MoE layers, the model has {len(moe_layers)}")
        for index, moe in enumerate(moe_layers):
            moe.expert_parallel, moe.layer_index = self, index
        self._moe_layers = moe_layers

    # -- the exchange ---------------------------------------------------------------------------
    def routed_experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       experts: ExpertWeights, backend) -> torch.Tensor:
        """``backend.routed_experts`` over every rank's experts: this rank's tokens ``x`` [T, hidden] with their
        logical experts ``ids`` and weights [T, k]; ``experts`` holds this rank's slots."""
        timer = self.exchange_time
        timer.start()
        if self.load is not None:
            self.load.record(layer, ids)
        physical = self.placement.physical(layer, ids)
        work = self.exchange.dispatch(x, physical, weights, self.placement.slots_per_rank)
        timer.stop()
        if work.rows.shape[0]:
            computed = backend.routed_experts(work.rows, work.slots.unsqueeze(1), work.weights.unsqueeze(1), experts)
        else:  # no token chose this rank's experts: some kernels cannot launch on zero rows
            computed = work.rows
        timer.start()
        out = self.exchange.combine(computed, work, x.shape[0])
        timer.stop()
        return out

    def idle_step(self, dtype: torch.dtype) -> None:
        """A rank without tokens this step still serves the others' tokens in every MoE layer."""
        for moe in self._moe_layers:
            moe.idle_exchange(dtype)

    # -- EPLB -----------------------------------------------------------------------------------
    def step_done(self) -> None:
        """Called by every rank after every step: swaps in moved weights, and starts a rebalance on schedule."""
        self.steps += 1
        if self._move is not None:
            self._swap()
        if self.load is not None and self.steps % self.step_interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        load = self.load.take()
        dist.all_reduce(load, group=self.ranks.device_group)
        load = load.cpu().double()
        if load.sum() == 0:
            return
        placement = self._placement(load).aligned_to(self.placement)
        static = ExpertPlacement.identity(self.num_layers, self.num_experts, self.ranks.world_size).balancedness(load)
        before, after = self.placement.to("cpu").balancedness(load), placement.balancedness(load)
        self.balancedness.append(Balancedness(static, before, after))
        if after >= before * _WORTH_MOVING:
            logger.info("EPLB: placement kept (max/mean rank load %.3f; a new one would give %.3f)", before, after)
            return
        changed = int((placement.phy2log != self.placement.phy2log.cpu()).sum())
        self._move = self._start_move(placement.to(self.ranks.device))
        logger.info("EPLB: %d expert slots change hands, for max/mean rank load %.3f -> %.3f (load of the last %d "
                    "steps); the weights move while generation goes on", changed, before, after, self.step_interval)

    def _placement(self, load: torch.Tensor) -> ExpertPlacement:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.ranks.world_size))
        nodes = max(1, self.ranks.world_size // local)
        return rebalance(load, self.num_physical, self.num_groups, nodes, self.ranks.world_size)

    def _start_move(self, new: ExpertPlacement) -> _Move:
        """Every rank lists the same moves in the same order; each takes part in its own with isend/irecv."""
        me, per_rank = self.ranks.rank, new.slots_per_rank
        ops, staged = [], []
        for layer, moe in enumerate(self._moe_layers):
            old_phy2log = self.placement.phy2log[layer].tolist()
            new_phy2log = new.phy2log[layer].tolist()
            stacks = [t for name in _STACKS for t in moe.expert_tensors(name)]
            for slot, expert in enumerate(new_phy2log):
                if old_phy2log[slot] == expert:
                    continue
                dest = slot // per_rank
                source_slot = _nearest_copy(old_phy2log, expert, dest, per_rank)
                source = source_slot // per_rank
                for tensor in stacks:
                    if dest == me and source == me:
                        staged.append((tensor, slot % per_rank, tensor[source_slot % per_rank].clone()))
                    elif dest == me:
                        buffer = torch.empty_like(tensor[0])
                        ops.append(dist.P2POp(dist.irecv, _bytes(buffer), source, group=self.ranks.device_group))
                        staged.append((tensor, slot % per_rank, buffer))
                    elif source == me:
                        ops.append(dist.P2POp(dist.isend, _bytes(tensor[source_slot % per_rank]), dest,
                                              group=self.ranks.device_group))
        works = dist.batch_isend_irecv(ops) if ops else []
        return _Move(new, works, staged)

    def _swap(self) -> None:
        move, self._move = self._move, None
        for work in move.works:
            work.wait()
        for tensor, slot, contents in move.staged:
            tensor[slot].copy_(contents)
        self.placement = move.placement
        self.swaps += 1


class ExchangeTimer:
    """Time spent dispatching and combining tokens (waits for slower peers included): device time from CUDA events
    on GPUs (read when asked, so the step is never synchronised for it), host time on CPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._pending: list = []
        self._begun = None

    def start(self) -> None:
        if self.cuda:
            self._begun = torch.cuda.Event(enable_timing=True)
            self._begun.record()
        else:
            self._begun = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._begun, end))
            if len(self._pending) > 4096:  # bounded: resolve the oldest ones, which have long completed
                self.total()
        else:
            self.seconds += time.perf_counter() - self._begun

    def total(self) -> float:
        for begun, end in self._pending:
            end.synchronize()
            self.seconds += begun.elapsed_time(end) / 1e3
        self._pending.clear()
        return self.seconds

    def reset(self) -> None:
        self.total()
        self.seconds = 0.0


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Weights travel as bytes: NCCL has no FP8 or e8m0 (MXFP4 scale) types."""
    return tensor.contiguous().view(torch.uint8)


def _nearest_copy(phy2log: list[int], expert: int, dest: int, per_rank: int) -> int:
    """The physical slot to copy ``expert`` from: one on the destination rank if it has one, else the first."""
    slots = [s for s, e in enumerate(phy2log) if e == expert]
    return next((s for s in slots if s // per_rank == dest), slots[0])
