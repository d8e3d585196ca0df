"""What batch-invariant mode assumes of this CPU's torch kernels, checked when an engine starts.

The CPU path rests on two measured properties of the kernels torch dispatches to, which depend on the instruction
set and thread count: a GEMM over a fixed-shape tile gives a row the same bits at every position of the tile, and
``exp``, ``log1p`` and the arithmetic operators give an element the same bits in the vector loop and in the scalar
loop that finishes a tensor (``sigmoid``, ``silu`` and ``softplus`` do not, so ``FixedRowTiles`` rebuilds them from
those). Where either fails the mode cannot hold, and the engine refuses to start rather than run with a weaker
guarantee.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer_batch_invariant.fixed_tiles import FixedRowTiles

_TAIL_FUNCTIONS = {
    "exp": torch.exp,
    "log1p": lambda x: torch.log1p(x.abs()),
    "arithmetic": lambda x: (x * 1.7 - 0.3) / (x.abs() + 2.0),
    "sigmoid (as rebuilt)": torch.sigmoid,
    "silu (as rebuilt)": F.silu,
    "softplus (as rebuilt)": F.softplus,
}


def _tile_positions_agree(rows: int, inner: int, outer: int, g: torch.Generator) -> bool:
    x = torch.randn(rows, inner, generator=g)
    w = torch.randn(outer, inner, generator=g)
    first = F.linear(x, w)[0]
    return all(torch.equal(F.linear(torch.roll(x, shift, 0), w)[shift], first) for shift in range(1, rows))


def _tails_agree(function, g: torch.Generator) -> bool:
    x = torch.randn(512, generator=g) * 6
    inside = function(x)  # every element checked below lies in this call's vector loop or in the same position
    return all(torch.equal(function(x[:n])[n - 1], inside[n - 1]) and torch.equal(function(x[n - 1:n])[0], inside[n - 1])
               for n in range(65, 161))


@functools.cache  # a property of this process's CPU and torch build
def cpu_problems(rows: int) -> tuple[str, ...]:
    """What does not hold on this CPU (empty when the mode can hold)."""
    g = torch.Generator().manual_seed(0)
    problems = [f"a GEMM over a {rows}-row tile gives a row different bits at different positions "
                f"({inner} x {outer} weights)"
                for inner, outer in ((256, 512), (1024, 64)) if not _tile_positions_agree(rows, inner, outer, g)]
    with FixedRowTiles(rows, tile_reductions=False, exact_tails=True):
        problems += [f"{name} rounds an element differently in torch's vector and scalar loops"
                     for name, function in _TAIL_FUNCTIONS.items() if not _tails_agree(function, g)]
    return tuple(problems)
