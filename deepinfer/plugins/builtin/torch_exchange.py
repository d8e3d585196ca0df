"""Reference token exchange for expert parallelism: ``torch.distributed.all_to_all_single`` (NCCL or Gloo)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.plugins.hookspecs import hookimpl
from deepinfer.plugins.interfaces import Dispatched


@dataclass(slots=True)
class _Route:
    token_of: torch.Tensor  # [N_sent] the token of each pair sent, in sending order
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllExchange:
    """Pairs go out sorted by destination rank; split sizes are exchanged first and read on the host."""

    name = "torch-all-to-all"

    def __init__(self, group, world_size: int):
        self.group, self.world_size = group, world_size

    def dispatch(self, x, physical, weights, slots_per_rank):
        k = physical.shape[1]
        flat = physical.flatten()
        destination = flat // slots_per_rank
        order = torch.argsort(destination, stable=True)
        sent = torch.bincount(destination, minlength=self.world_size)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        route = _Route(order // k, sent.tolist(), received.tolist())
        rows = self._send(x[route.token_of], route.recv_splits, route.send_splits)
        slots = self._send(flat[order] % slots_per_rank, route.recv_splits, route.send_splits)
        scales = self._send(weights.flatten()[order].float(), route.recv_splits, route.send_splits)
        return Dispatched(rows, slots, scales, route)

    def combine(self, computed, dispatched, num_tokens):
        route = dispatched.handle
        back = self._send(computed, route.send_splits, route.recv_splits)
        summed = torch.zeros(num_tokens, computed.shape[1], dtype=torch.float32, device=computed.device)
        summed.index_add_(0, route.token_of, back.float())
        return summed.to(computed.dtype)

    def _send(self, rows: torch.Tensor, recv_splits: list[int], send_splits: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=self.group)
        return out


@hookimpl(trylast=True)
def deepinfer_token_exchange(config, ranks):
    return AllToAllExchange(ranks.device_group, ranks.world_size)
