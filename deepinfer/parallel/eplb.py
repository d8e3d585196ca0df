"""Expert-parallel load balancing (EPLB): where each MoE expert's weights live.

Given the measured load of every logical expert, hot experts get redundant copies ("replicas") and the
physical copies are laid out over ranks so every rank computes roughly the same number of tokens. This
follows the greedy policy of DeepSeek's EPLB: when expert groups divide evenly over nodes, whole groups are
first packed onto nodes (group-limited routing then keeps a token's traffic inside few nodes), replicas are
added within each node, and each node's physical experts are packed onto its ranks; otherwise the same steps
run with one node and one group. Placements are computed on the host (a few Python loops over experts,
vectorized over layers); only `ExpertPlacement.physical` and `ExpertLoad` run on the serving device.
"""

from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor


def balanced_packing(weight: Tensor, num_packs: int) -> tuple[Tensor, Tensor]:
    """Split the n items of each row of ``weight`` [L, n] into ``num_packs`` packs of exactly n/num_packs.

    Greedy: the heaviest remaining item goes into the currently lightest pack that still has room (ties go to
    the lowest pack index). Returns ``(pack, slot_in_pack)``, both int64 [L, n].
    """
    num_layers, num_items = weight.shape
    if num_packs <= 0 or num_items % num_packs:
        raise ValueError(f"cannot split {num_items} items into {num_packs} equal packs")
    capacity = num_items // num_packs
    # A stable sort keeps equal weights in index order, so the result never depends on sort internals.
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    pack = torch.empty(num_layers, num_items, dtype=torch.int64)
    slot = torch.empty_like(pack)
    pack_weight = torch.zeros(num_layers, num_packs, dtype=torch.float64)
    pack_size = torch.zeros(num_layers, num_packs, dtype=torch.int64)
    layers = torch.arange(num_layers)
    for step in range(num_items):
        item = order[:, step]
        # Full packs are hidden behind +inf; argmin returns the first minimum, i.e. the lowest pack index.
        open_weight = pack_weight.masked_fill(pack_size >= capacity, float("inf"))
        chosen = open_weight.argmin(dim=1)
        pack[layers, item] = chosen
        slot[layers, item] = pack_size[layers, chosen]
        pack_weight[layers, chosen] += weight[layers, item].double()
        pack_size[layers, chosen] += 1
    return pack, slot


def replicate(weight: Tensor, num_physical: int) -> tuple[Tensor, Tensor, Tensor]:
    """Choose which logical experts of ``weight`` [L, n_logical] get the extra physical slots.

    Physical slots 0..n_logical-1 hold the logical experts themselves; every further slot copies the expert
    whose per-replica load (weight / count) is currently largest (ties: lowest index). Returns
    ``(phy2log [L, P], replica_index [L, P], count [L, n_logical])``.
    """
    num_layers, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} logical experts")
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(num_layers, 1)
    replica_index = torch.zeros(num_layers, num_physical, dtype=torch.int64)
    count = torch.ones(num_layers, num_logical, dtype=torch.int64)
    weight = weight.double()
    layers = torch.arange(num_layers)
    for phy in range(num_logical, num_physical):
        hottest = (weight / count).argmax(dim=1)
        phy2log[:, phy] = hottest
        replica_index[:, phy] = count[layers, hottest]
        count[layers, hottest] += 1
    return phy2log, replica_index, count


def _inverse(perm: Tensor) -> Tensor:
    """Row-wise inverse of a batch of permutations [L, n]."""
    inverse = torch.empty_like(perm)
    inverse.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm))
    return inverse


def _hierarchical(weight: Tensor, num_physical: int, num_groups: int, num_nodes: int,
                  num_ranks: int) -> tuple[Tensor, Tensor, Tensor]:
    """Groups -> nodes, replicas within each node, physical experts -> the node's ranks.

    Returns ``(phy2log, replica_index, count)`` with physical slots ordered rank-major.
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    physical_per_node = num_physical // num_nodes
    slots_per_rank = num_physical // num_ranks

    # 1. Whole groups onto nodes. Renumber logical experts node-major ("node order") so that each node's
    #    experts form a contiguous block and the later steps can treat every node as an independent row.
    group_load = weight.view(num_layers, num_groups, group_size).sum(-1)
    group_node, group_slot = balanced_packing(group_load, num_nodes)
    group_start = (group_node * (num_groups // num_nodes) + group_slot) * group_size
    log2ord = (group_start.unsqueeze(-1) + torch.arange(group_size)).flatten(1)
    ord2log = _inverse(log2ord)

    # 2. Replicas within each node: rows are (layer, node) pairs.
    node_load = weight.gather(1, ord2log).view(num_layers * num_nodes, experts_per_node)
    phy2ord, replica, ord_count = replicate(node_load, physical_per_node)

    # 3. Each node's physical experts onto its ranks, weighing a replica by its share of the expert's load.
    replica_load = (node_load / ord_count).gather(1, phy2ord)
    rank, rank_slot = balanced_packing(replica_load, num_ranks // num_nodes)
    final2phy = _inverse(rank * slots_per_rank + rank_slot)

    node_offset = (torch.arange(num_nodes) * experts_per_node).repeat(num_layers).unsqueeze(1)
    final2ord = (phy2ord.gather(1, final2phy) + node_offset).view(num_layers, num_physical)
    phy2log = ord2log.gather(1, final2ord)
    replica_index = replica.gather(1, final2phy).view(num_layers, num_physical)
    count = ord_count.view(num_layers, num_experts).gather(1, log2ord)
    return phy2log, replica_index, count


@dataclass(slots=True)
class ExpertPlacement:
    """Which logical expert each physical slot holds; slot p lives on rank p // slots_per_rank."""

    phy2log: Tensor  # int64 [L, P]
    log2phy: Tensor  # int64 [L, E, R]: an expert's physical slots by replica index, padded with -1
    count: Tensor  # int64 [L, E]: replicas per logical expert (>= 1)
    num_ranks: int

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.shape[1] // self.num_ranks

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_ranks: int) -> "ExpertPlacement":
        """Static sharding without redundancy: expert e on rank e // (num_experts / num_ranks)."""
        if num_ranks <= 0 or num_experts % num_ranks:
            raise ValueError(f"{num_experts} experts do not split evenly over {num_ranks} ranks")
        experts = torch.arange(num_experts, dtype=torch.int64).repeat(num_layers, 1)
        return cls(experts, experts.unsqueeze(-1).clone(), torch.ones_like(experts), num_ranks)

    def to(self, device: torch.device | str) -> "ExpertPlacement":
        return ExpertPlacement(self.phy2log.to(device), self.log2phy.to(device), self.count.to(device),
                               self.num_ranks)

    def local_experts(self, layer: int, rank: int) -> list[int]:
        """The logical expert held by each local slot of ``rank``."""
        start = rank * self.slots_per_rank
        return self.phy2log[layer, start:start + self.slots_per_rank].tolist()

    def physical(self, layer: int, topk_ids: Tensor) -> Tensor:
        """Map routed logical experts [T, k] to the physical slots that serve them.

        Replica (token + choice) % count is deterministic (batch-invariant for a given position) and spreads
        consecutive tokens of a hot expert round-robin over its replicas. Pure tensor ops: no host sync.
        """
        tokens = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)
        choices = torch.arange(topk_ids.shape[1], device=topk_ids.device)
        replica = (tokens + choices) % self.count[layer][topk_ids]
        return self.log2phy[layer][topk_ids, replica]

    def aligned_to(self, previous: "ExpertPlacement") -> "ExpertPlacement":
        """The same experts on the same ranks, each rank's slots reordered so that an expert the rank already
        held stays in its slot: only the experts new to a rank have to move there."""
        per_rank = self.slots_per_rank
        new, old = self.phy2log.tolist(), previous.phy2log.cpu().tolist()
        for layer, (slots, held) in enumerate(zip(new, old)):
            for start in range(0, len(slots), per_rank):
                wanted = Counter(slots[start:start + per_rank])
                kept = []
                for expert in held[start:start + per_rank]:
                    stays = wanted[expert] > 0
                    wanted[expert] -= stays
                    kept.append(expert if stays else None)
                arriving = iter(sorted(wanted.elements()))
                new[layer][start:start + per_rank] = [e if e is not None else next(arriving) for e in kept]
        phy2log = torch.tensor(new, dtype=torch.int64)
        replica_index = torch.zeros_like(phy2log)
        for layer, slots in enumerate(new):
            seen = Counter()
            for slot, expert in enumerate(slots):
                replica_index[layer, slot] = seen[expert]
                seen[expert] += 1
        return _placement(phy2log, replica_index, self.count.cpu(), self.num_ranks)

    def rank_load(self, load: Tensor) -> Tensor:
        """Tokens per rank [L, num_ranks] if each expert's ``load`` [L, E] splits evenly over its replicas."""
        count = self.count.to(load.device)
        phy2log = self.phy2log.to(load.device)
        per_slot = (load.double() / count).gather(1, phy2log)
        return per_slot.view(load.shape[0], self.num_ranks, self.slots_per_rank).sum(-1)

    def balancedness(self, load: Tensor) -> float:
        """Mean over layers of max rank load / mean rank load; 1.0 is perfect (idle layers count as 1.0)."""
        ranks = self.rank_load(load)
        mean = ranks.mean(dim=1)
        ratio = torch.where(mean > 0, ranks.max(dim=1).values / mean.clamp_min(1e-12), 1.0)
        return ratio.mean().item()


def rebalance(weight: Tensor, num_physical: int, num_groups: int, num_nodes: int,
              num_ranks: int) -> ExpertPlacement:
    """Place ``num_physical`` expert copies per layer on ``num_ranks`` ranks for the load ``weight`` [L, E].

    Hierarchical (group-aware) when the ``num_groups`` expert groups split evenly over ``num_nodes``,
    otherwise global. The result lives on the CPU; move it with ``ExpertPlacement.to``.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_layers, num_experts], got shape {tuple(weight.shape)}")
    num_layers, num_experts = weight.shape
    for name, value in (("num_physical", num_physical), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_ranks", num_ranks)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_physical < num_experts:
        raise ValueError(f"num_physical ({num_physical}) must be >= the number of experts ({num_experts})")
    if num_physical % num_ranks:
        raise ValueError(f"num_physical ({num_physical}) is not divisible by num_ranks ({num_ranks})")
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks ({num_ranks}) is not divisible by num_nodes ({num_nodes})")
    if num_experts % num_groups:
        raise ValueError(f"the number of experts ({num_experts}) is not divisible by num_groups ({num_groups})")
    # float64 on the host: exact for token counts, and the greedy ties are then reproducible.
    weight = weight.detach().to("cpu", torch.float64)
    if num_groups % num_nodes == 0:
        phy2log, replica_index, count = _hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)
    else:
        phy2log, replica_index, count = _hierarchical(weight, num_physical, 1, 1, num_ranks)
    return _placement(phy2log, replica_index, count, num_ranks)


def _placement(phy2log: Tensor, replica_index: Tensor, count: Tensor, num_ranks: int) -> ExpertPlacement:
    num_layers, num_experts = count.shape
    num_physical = phy2log.shape[1]
    # A fixed replica width (the most any one expert can get) keeps log2phy's shape independent of the load,
    # so a serving buffer can be overwritten in place when the placement changes.
    width = num_physical - num_experts + 1
    log2phy = torch.full((num_layers, num_experts * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * width + replica_index, torch.arange(num_physical).expand(num_layers, -1))
    return ExpertPlacement(phy2log, log2phy.view(num_layers, num_experts, width), count, num_ranks)


class ExpertLoad:
    """Per-layer, per-logical-expert routed-token counts, accumulated on the device without host syncs."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)

    def record(self, layer: int, topk_ids: Tensor) -> None:
        """Count the routed choices ``topk_ids`` [T, k] (ids must be in [0, num_experts))."""
        ids = topk_ids.flatten()
        # index_add_ rather than bincount: bincount reads the max id back to the host to size its output.
        self.counts[layer].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))

    def take(self) -> Tensor:
        """The counts so far [L, E]; the buffer is then zeroed in place (its address stays graph-safe)."""
        counts = self.counts.clone()
        self.counts.zero_()
        return counts
