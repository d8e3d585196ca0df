from collections import Counter

import pytest
import torch

from deepinfer.parallel.eplb import ExpertLoad, ExpertPlacement, balanced_packing, rebalance, replicate


def zipf_load(num_layers: int, num_experts: int, exponent: float, seed: int = 0,
              tokens: int = 100_000) -> torch.Tensor:
    """Zipf-like token counts per expert, with the hot experts at a different random position per layer."""
    generator = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    rows = [base[torch.randperm(num_experts, generator=generator)] for _ in range(num_layers)]
    return (torch.stack(rows) / base.sum() * tokens).round()


def check_consistent(placement: ExpertPlacement, num_experts: int) -> None:
    """phy2log, log2phy and count describe the same placement, and every expert has a replica."""
    num_layers, num_physical = placement.phy2log.shape
    assert placement.count.shape == (num_layers, num_experts)
    assert (placement.count >= 1).all()
    assert placement.count.sum(1).eq(num_physical).all()
    for layer in range(num_layers):
        phy2log = placement.phy2log[layer].tolist()
        assert Counter(phy2log) == {e: c for e, c in enumerate(placement.count[layer].tolist())}
        for expert in range(num_experts):
            slots = placement.log2phy[layer, expert]
            used = slots[slots >= 0].tolist()
            assert len(used) == placement.count[layer, expert]
            # The padding comes after the used replica indices.
            assert slots[:len(used)].tolist() == used
            assert all(phy2log[slot] == expert for slot in used)
        assert placement.slots_per_rank * placement.num_ranks == num_physical
        local = [placement.local_experts(layer, rank) for rank in range(placement.num_ranks)]
        assert all(len(slots) == placement.slots_per_rank for slots in local)
        assert sum(local, []) == phy2log


def test_balanced_packing_greedy_example():
    # Heaviest first into the lightest open pack: 9->A, 8->B, 7->B, 6->A, 5->A (tie 15/15 -> A), 4->B.
    pack, slot = balanced_packing(torch.tensor([[9.0, 8, 7, 6, 5, 4]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert slot.tolist() == [[0, 0, 1, 1, 2, 2]]
    # Capacity wins over lightness: after 10->A, 1->B, 1->B pack B is full, so the last item must go to A.
    pack, slot = balanced_packing(torch.tensor([[10.0, 1, 1, 1]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0]]
    assert slot.tolist() == [[0, 0, 1, 1]]


def test_balanced_packing_equal_sizes_and_unique_slots():
    weight = torch.rand(5, 24, generator=torch.Generator().manual_seed(1))
    for num_packs in (1, 2, 3, 4, 6, 24):
        pack, slot = balanced_packing(weight, num_packs)
        size = 24 // num_packs
        for layer in range(5):
            assert Counter(pack[layer].tolist()) == {p: size for p in range(num_packs)}
            positions = set(zip(pack[layer].tolist(), slot[layer].tolist()))
            assert positions == {(p, s) for p in range(num_packs) for s in range(size)}
    with pytest.raises(ValueError, match="24 items into 5"):
        balanced_packing(weight, 5)


def test_replicate_gives_extra_slots_to_the_hottest():
    phy2log, replica, count = replicate(torch.tensor([[6.0, 3, 1]]), 5)
    # 6/1 is largest -> expert 0; then 6/2 == 3/1 ties -> lowest index, expert 0 again.
    assert phy2log.tolist() == [[0, 1, 2, 0, 0]]
    assert replica.tolist() == [[0, 0, 0, 1, 2]]
    assert count.tolist() == [[3, 1, 1]]


@pytest.mark.parametrize("num_groups,num_nodes,num_ranks", [(8, 1, 2), (8, 1, 4), (8, 2, 4), (3, 2, 4), (4, 4, 8)])
def test_rebalance_is_consistent(num_groups, num_nodes, num_ranks):
    num_experts = 48 if num_groups == 3 else 64
    weight = zipf_load(3, num_experts, 1.2, seed=num_ranks)
    placement = rebalance(weight, num_experts + 16, num_groups, num_nodes, num_ranks)
    check_consistent(placement, num_experts)
    assert placement.slots_per_rank == (num_experts + 16) // num_ranks


def test_hierarchical_keeps_groups_on_one_node():
    num_experts, num_groups, num_nodes, num_physical = 64, 8, 2, 80
    placement = rebalance(zipf_load(4, num_experts, 1.2), num_physical, num_groups, num_nodes, 4)
    per_node = num_physical // num_nodes
    group_size = num_experts // num_groups
    for layer in range(4):
        nodes_of_group = {}
        for slot, expert in enumerate(placement.phy2log[layer].tolist()):
            nodes_of_group.setdefault(expert // group_size, set()).add(slot // per_node)
        assert len(nodes_of_group) == num_groups
        assert all(len(nodes) == 1 for nodes in nodes_of_group.values())
        # Groups are packed evenly: each node holds num_groups / num_nodes whole groups.
        assert Counter(next(iter(n)) for n in nodes_of_group.values()) == {0: 4, 1: 4}


@pytest.mark.parametrize("num_experts,num_physical,num_groups,num_nodes,num_ranks,exponent,identity_min,balanced_max", [
    # Measured: identity 1.513 -> 1.0001 (2 ranks, global), 1.661 -> 1.0002 (4 ranks, global),
    # 1.661 -> 1.063 (4 ranks over 2 nodes: whole groups per node limit how even it can get).
    (32, 40, 4, 1, 2, 1.5, 1.45, 1.05),
    (64, 80, 8, 1, 4, 1.2, 1.5, 1.05),
    (64, 80, 8, 2, 4, 1.2, 1.5, 1.15),
])
def test_rebalance_improves_balancedness(num_experts, num_physical, num_groups, num_nodes, num_ranks, exponent,
                                         identity_min, balanced_max):
    load = zipf_load(4, num_experts, exponent)
    identity = ExpertPlacement.identity(4, num_experts, num_ranks).balancedness(load)
    balanced = rebalance(load, num_physical, num_groups, num_nodes, num_ranks).balancedness(load)
    assert identity > identity_min
    assert balanced < balanced_max


def test_identity_and_rank_load():
    placement = ExpertPlacement.identity(2, 8, 4)
    check_consistent(placement, 8)
    assert placement.local_experts(1, 2) == [4, 5]
    load = torch.arange(16, dtype=torch.float64).view(2, 8)
    assert placement.rank_load(load).tolist() == [[1, 5, 9, 13], [17, 21, 25, 29]]
    assert placement.balancedness(torch.ones(2, 8)) == pytest.approx(1.0)
    assert placement.balancedness(torch.zeros(2, 8)) == pytest.approx(1.0)
    # A replicated expert's load splits evenly over its replicas.
    phy2log, replica, count = replicate(torch.tensor([[4.0, 1]]), 4)
    log2phy = torch.full((1, 2, 3), -1)
    log2phy[0, phy2log[0], replica[0]] = torch.arange(4)
    split = ExpertPlacement(phy2log, log2phy, count, num_ranks=2)
    assert split.rank_load(torch.tensor([[9.0, 3]])).tolist() == [[6, 6]]  # slots [0, 1 | 0, 0]


def test_physical_maps_to_replicas_and_spreads_hot_experts():
    num_experts = 16
    load = torch.zeros(2, num_experts)
    load[:, 3] = 1000  # one very hot expert per layer
    load += 1
    placement = rebalance(load, 24, 1, 1, 4)
    assert placement.count[1, 3] > 2
    generator = torch.Generator().manual_seed(3)
    topk = torch.randint(0, num_experts, (50, 4), generator=generator)
    topk[:, 0] = 3
    for layer in range(2):
        slots = placement.physical(layer, topk)
        assert slots.shape == topk.shape
        assert torch.equal(placement.phy2log[layer][slots], topk)
        hot = Counter(slots[:, 0].tolist())
        replicas = placement.count[layer, 3].item()
        assert len(hot) == replicas
        assert max(hot.values()) - min(hot.values()) <= 1  # round-robin over tokens


def test_expert_load_counts():
    generator = torch.Generator().manual_seed(4)
    recorder = ExpertLoad(3, 10, "cpu")
    batches = [(layer % 3, torch.randint(0, 10, (7, 2), generator=generator)) for layer in range(9)]
    expected = [[0] * 10 for _ in range(3)]
    for layer, topk in batches:
        recorder.record(layer, topk)
        for expert in topk.flatten().tolist():
            expected[layer][expert] += 1
    counts = recorder.take()
    assert counts.dtype == torch.int64
    assert counts.tolist() == expected
    assert recorder.take().eq(0).all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_physical=66), "num_physical \\(66\\) is not divisible by num_ranks \\(4\\)"),
    (dict(num_physical=60), "num_physical \\(60\\) must be >= the number of experts \\(64\\)"),
    (dict(num_nodes=3), "num_ranks \\(4\\) is not divisible by num_nodes \\(3\\)"),
    (dict(num_groups=5), "number of experts \\(64\\) is not divisible by num_groups \\(5\\)"),
    (dict(num_ranks=0), "num_ranks must be positive"),
])
def test_rebalance_rejects_bad_arguments(kwargs, message):
    arguments = dict(num_physical=80, num_groups=8, num_nodes=2, num_ranks=4) | kwargs
    with pytest.raises(ValueError, match=message):
        rebalance(torch.ones(2, 64), **arguments)
    with pytest.raises(ValueError, match="weight must be"):
        rebalance(torch.ones(64), 64, 1, 1, 4)
    with pytest.raises(ValueError, match="do not split evenly"):
        ExpertPlacement.identity(1, 10, 4)


def test_aligned_placement_keeps_what_each_rank_already_holds():
    generator = torch.Generator().manual_seed(3)
    first = rebalance(torch.rand(3, 16, generator=generator, dtype=torch.float64) * 100, 20, 1, 1, 4)
    load = torch.rand(3, 16, generator=generator, dtype=torch.float64) * 100
    fresh = rebalance(load, 20, 1, 1, 4)
    aligned = fresh.aligned_to(first)
    for layer in range(3):
        for rank in range(4):  # the same experts on each rank, and every one it already held in its old slot
            new, old = aligned.local_experts(layer, rank), first.local_experts(layer, rank)
            assert sorted(new) == sorted(fresh.local_experts(layer, rank))
            # as many slots keep their expert as the old and new multisets share: nothing needlessly moves
            same = sum(a == b for a, b in zip(new, old))
            assert same == sum((Counter(new) & Counter(old)).values())
    # consistent tables, and balance unchanged
    for layer in range(3):
        for slot, expert in enumerate(aligned.phy2log[layer].tolist()):
            assert slot in aligned.log2phy[layer, expert].tolist()
    assert aligned.balancedness(load) == pytest.approx(fresh.balancedness(load))
    moved = lambda p: int((p.phy2log != first.phy2log).sum())  # noqa: E731
    assert moved(aligned) < moved(fresh)
