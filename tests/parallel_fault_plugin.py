"""A plugin for tests/test_parallel.py, imported by name in spawned ranks: rank 1 fails at its third step (a stand-in
for any error on one rank)."""

import torch.distributed as dist

from deepinfer.plugins.hookspecs import hookimpl

MESSAGE = "injected failure on rank 1 at its third step"


class _FailOnRankOne:
    steps = 0

    def __enter__(self):
        if dist.is_initialized() and dist.get_rank() == 1:
            _FailOnRankOne.steps += 1
            if _FailOnRankOne.steps == 3:
                raise RuntimeError(MESSAGE)

    def __exit__(self, *exc):
        return False


@hookimpl
def deepinfer_step_context(config, device):
    return _FailOnRankOne()
