"""Products and row reductions over a step's tokens, computed in tiles of a fixed row count.

A GEMM library picks its blocking, and with it each output's summation order, from the matrices' shapes: a token's
projection computed among 5 rows can differ in the last bit from the same projection among 300 (measured with MKL:
row 0 of ``x[:M] @ W.T`` takes three different values over M = 1..600). Cut into tiles of a fixed number of rows,
the last one zero-padded, every call has the same shapes, so a row's result depends on the row alone (measured: the
same bits at every position of a tile). Reductions also choose their layout from the number of rows reduced (CUDA's
kernels, and CPU ones over short rows), so sums, means, softmaxes and norms over a row are tiled the same way.

On CPUs, torch's element-wise kernels run vector code over a tensor and finish the elements past its last full
vector with a scalar loop, and for some functions the two round differently (measured: ``sigmoid``, ``silu`` and
``softplus``; not ``exp``, ``log``, ``sqrt`` or the arithmetic operators). Which of a row's elements fall past the
last full vector depends on how many rows the tensor has, so those functions are computed from ``exp``, ``log1p``
and arithmetic instead.

Tiles are cut along dimension 0, which is the token dimension wherever the model multiplies activations; cutting
any other leading dimension is still exact, only slower.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def in_row_tiles(x: torch.Tensor, rows: int, compute: Callable[[torch.Tensor], torch.Tensor],
                 out_dim: int = 0) -> torch.Tensor:
    """``compute(x)`` as the concatenation along ``out_dim`` of ``compute`` over ``rows``-row tiles of ``x``.

    ``compute`` must treat the rows of ``x`` independently and map dimension 0 of its input to ``out_dim`` of its
    output. The padding rows are zeros and are cut from the result.
    """
    total = x.shape[0]
    if total == 0:
        return compute(x)
    padding = (-total) % rows
    if padding:
        x = torch.cat([x, x.new_zeros((padding, *x.shape[1:]))])
    tiles = [compute(x[start:start + rows].contiguous()) for start in range(0, total + padding, rows)]
    return torch.cat(tiles, dim=out_dim).narrow(out_dim, 0, total)


def _einsum_operands(args) -> tuple[str, list]:
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return equation, operands


def _einsum_token_dim(equation: str) -> int | None:
    """Where the first operand's leading index lands in the output, when only that operand carries it (a row
    dimension, as ``t`` in ``tgd,grd->tgr``); ``None`` when the equation has no such index."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    inputs, output = equation.split("->")
    first, *others = inputs.split(",")
    if not first:
        return None
    index = first[0]
    if index in first[1:] or any(index in other for other in others) or index not in output:
        return None
    return output.index(index)


def _reduced_dims(dim, ndim: int) -> tuple[int, ...] | None:
    if dim is None:
        return None
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    return tuple(d % ndim for d in dims)


class FixedRowTiles(TorchFunctionMode):
    """While active, every matrix product whose left operand has rows (``F.linear``, ``@``, ``matmul``, ``mm``,
    ``addmm``, ``einsum`` with a row index) runs in ``rows``-row tiles. With ``tile_reductions``, so do ``sum``,
    ``mean``, ``softmax``, ``log_softmax`` and ``cumsum`` over dimensions other than 0, and ``F.rms_norm``; with
    ``exact_tails`` (CPUs),
    ``sigmoid``, ``silu`` and ``softplus`` are computed from functions whose vector and scalar code agree."""

    def __init__(self, rows: int, tile_reductions: bool, exact_tails: bool):
        super().__init__()
        self.rows = rows
        self.handlers = dict(_PRODUCTS)
        if tile_reductions:
            self.handlers.update(_REDUCTIONS)
        if exact_tails:
            self.handlers.update(_TAIL_SAFE)
        extras = [what for what, on in (("row reductions", tile_reductions), ("tail-safe sigmoid", exact_tails)) if on]
        self.name = f"batch-invariant fixed row tiles ({rows} rows{''.join(', ' + e for e in extras)})"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = self.handlers.get(func)
        if handler:
            # the mode is off inside its own handler, so the tiles' calls reach torch
            return handler(self.rows, func, args, kwargs)
        return func(*args, **kwargs)


def _product(rows, func, args, kwargs):
    left, right, *rest = args
    if left.dim() < 2 or right.dim() != 2:
        return func(*args, **kwargs)
    return in_row_tiles(left, rows, lambda tile: func(tile, right, *rest, **kwargs))


def _addmm(rows, func, args, kwargs):
    bias, left, right, *rest = args
    if bias.dim() == 2 and bias.shape[0] != 1:  # a per-row bias would need tiling too; not used by the models
        return func(*args, **kwargs)
    return in_row_tiles(left, rows, lambda tile: func(bias, tile, right, *rest, **kwargs))


def _einsum(rows, func, args, kwargs):
    equation, operands = _einsum_operands(args)
    out_dim = _einsum_token_dim(equation)
    if out_dim is None or operands[0].dim() < 2:
        return func(*args, **kwargs)
    first, *others = operands
    return in_row_tiles(first, rows, lambda tile: func(equation, tile, *others, **kwargs), out_dim)


def _row_reduction(rows, func, args, kwargs):
    x, *rest = args
    dim = rest[0] if rest else kwargs.get("dim")
    dims = _reduced_dims(dim, x.dim()) if isinstance(x, torch.Tensor) and x.dim() >= 2 else None
    if dims is None or 0 in dims:
        return func(*args, **kwargs)
    return in_row_tiles(x, rows, lambda tile: func(tile, *rest, **kwargs))


def _rms_norm(rows, func, args, kwargs):
    x, normalized_shape, *rest = args
    normalized_dims = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    if x.dim() <= normalized_dims:
        return func(*args, **kwargs)
    return in_row_tiles(x, rows, lambda tile: func(tile, normalized_shape, *rest, **kwargs))


_PRODUCTS = {
    F.linear: _product,  # (x, weight, bias): the weight is the 2-D right operand
    torch.matmul: _product,
    torch.Tensor.matmul: _product,
    torch.Tensor.__matmul__: _product,
    torch.mm: _product,
    torch.Tensor.mm: _product,
    torch.addmm: _addmm,
    torch.einsum: _einsum,
}
_REDUCTIONS = {
    func: _row_reduction
    for func in (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean, torch.softmax, torch.Tensor.softmax,
                 F.softmax, torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax, torch.cumsum,
                 torch.Tensor.cumsum)
} | {F.rms_norm: _rms_norm}


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    scaled = x * beta
    return torch.where(scaled > threshold, x, torch.log1p(torch.exp(scaled)) / beta)


_TAIL_SAFE = {
    torch.sigmoid: lambda rows, func, args, kwargs: _sigmoid(*args, **kwargs),
    torch.Tensor.sigmoid: lambda rows, func, args, kwargs: _sigmoid(*args, **kwargs),
    F.silu: lambda rows, func, args, kwargs: args[0] * _sigmoid(args[0]),
    F.softplus: lambda rows, func, args, kwargs: _softplus(*args, **kwargs),
}
