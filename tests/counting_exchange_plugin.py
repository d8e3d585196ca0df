"""A ``deepinfer_token_exchange`` plugin for tests/test_parallel.py, imported by name in spawned ranks: the built-in
all-to-all exchange, counting its calls."""

from deepinfer.plugins.builtin.torch_exchange import AllToAllExchange
from deepinfer.plugins.hookspecs import hookimpl


class CountingExchange(AllToAllExchange):
    name = "counting-all-to-all"

    def __init__(self, group, world_size: int):
        super().__init__(group, world_size)
        self.dispatches = self.combines = 0

    def dispatch(self, x, physical, weights, slots_per_rank):
        self.dispatches += 1
        return super().dispatch(x, physical, weights, slots_per_rank)

    def combine(self, computed, dispatched, num_tokens):
        self.combines += 1
        return super().combine(computed, dispatched, num_tokens)


@hookimpl
def deepinfer_token_exchange(config, ranks):
    return CountingExchange(ranks.device_group, ranks.world_size)
