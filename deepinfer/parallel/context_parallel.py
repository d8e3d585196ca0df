"""Balanced context parallelism: the ranks share every step's tokens.

Every rank runs the same requests with the same scheduler, so every rank builds the same step. Each rank then
computes only its share of the step's tokens through every layer (projections, MoE, mHC, its tokens' attention).
What a token leaves in the caches (its window row, its compressor-state row, a ratio-1 entry) is gathered from
all ranks before it is written, so every rank's caches hold the whole sequence and its queries can read any key:
DeepSeek-V4's keys are one 512-wide row per token, so the gather moves little next to the work it splits. The final
hidden rows are gathered too, and every rank samples the same tokens from the same logits.

The split is zigzag per request: a run of n >= 2N tokens of one request (a prefill chunk) is cut into 2N pieces and
rank r takes pieces r and 2N-1-r, so each rank gets as many early (cheap) as late (expensive) queries of a causal
prefill; shorter runs (decode tokens) are dealt round-robin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from deepinfer.parallel.ranks import Ranks

if TYPE_CHECKING:  # the engine's step contract; parallel sits below the engine and imports nothing of it at run time
    from deepinfer.runtime.scheduled import ScheduledBatch


@dataclass(slots=True)
class ContextShare:
    """One step's split: this rank's rows, and where each step row lands in the gathered (padded) rows."""

    rows: torch.Tensor  # [t] this rank's token rows, in step order
    index: torch.Tensor  # [T] each step row's place in the [N * most, ...] gathered tensor
    most: int  # the largest share: every rank's rows are padded to it for the gather
    group: object

    def gather(self, own: torch.Tensor) -> torch.Tensor:
        padded = own.new_zeros((self.most, *own.shape[1:]))
        padded[:own.shape[0]] = own
        gathered = own.new_empty((self.most * dist.get_world_size(self.group), *own.shape[1:]))
        _all_gather(gathered, padded, group=self.group)
        return gathered[self.index]


# torch 2.13 renamed all_gather_into_tensor (the GPU machine's 2.11 has only the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def zigzag_owners(run_lengths: list[int], ranks: int) -> list[int]:
    """The rank computing each token of a step whose requests contribute runs of ``run_lengths`` tokens."""
    owners, dealt = [], 0
    for n in run_lengths:
        if n >= 2 * ranks:
            pieces = 2 * ranks
            for piece in range(pieces):
                size = n * (piece + 1) // pieces - n * piece // pieces
                owners += [piece if piece < ranks else pieces - 1 - piece] * size
        else:
            owners += [(dealt + i) % ranks for i in range(n)]
            dealt += n
    return owners


class ContextParallel:
    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def share(self, scheduled: ScheduledBatch) -> ContextShare:
        """This rank's share of the step ``scheduled``."""
        world, me = self.ranks.world_size, self.ranks.rank
        owners = zigzag_owners([row.count for row in scheduled], world)
        counts, place = [0] * world, []
        for owner in owners:
            place.append(counts[owner])
            counts[owner] += 1
        most = max(counts)
        index = [owner * most + p for owner, p in zip(owners, place)]
        device = self.ranks.device
        # a rank without a token of its own (a step of fewer tokens than ranks) computes row 0 again and drops
        # it: some kernels cannot run on zero rows, and its collectives must still run
        rows = [row for row, owner in enumerate(owners) if owner == me] or [0]
        return ContextShare(torch.tensor(rows, dtype=torch.int64, device=device),
                            torch.tensor(index, dtype=torch.int64, device=device), most, self.ranks.device_group)
