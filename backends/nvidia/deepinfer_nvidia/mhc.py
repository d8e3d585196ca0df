"""mHC coefficients in one Triton launch: the sigmoids and the whole Sinkhorn loop of each token in registers.

The reference spends ~120 kernel launches per call on [T, 4, 4] matrices (softmax, then 20 rounds of two
normalisations), and the model calls it twice per layer: at decode that launch count, not arithmetic, is the cost.
Here one program takes a block of tokens, keeps their n x n matrices in registers and unrolls the iterations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16


@triton.jit
def _mhc_kernel(logits_ptr, stride_l, pre_ptr, post_ptr, comb_ptr, T, eps, N: tl.constexpr, ITERS: tl.constexpr,
                BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    i = tl.arange(0, N)
    base = logits_ptr + rows.to(tl.int64) * stride_l
    pre = tl.sigmoid(tl.load(base[:, None] + i[None, :], mask=ok[:, None], other=0.0)) + eps
    post = 2 * tl.sigmoid(tl.load(base[:, None] + N + i[None, :], mask=ok[:, None], other=0.0))
    cell = i[:, None] * N + i[None, :]  # [N, N]: row-major position of comb[r, c]
    x = tl.load(base[:, None, None] + 2 * N + cell[None, :, :], mask=ok[:, None, None], other=0.0)
    e = tl.exp(x - tl.max(x, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    tl.store(pre_ptr + rows[:, None] * N + i[None, :], pre, mask=ok[:, None])
    tl.store(post_ptr + rows[:, None] * N + i[None, :], post, mask=ok[:, None])
    tl.store(comb_ptr + rows[:, None, None] * (N * N) + cell[None, :, :], comb, mask=ok[:, None, None])


class TritonMHC:
    name = "triton"
    graph_safe = True

    def coefficients(self, logits, hc_mult, sinkhorn_iters, eps):
        n = hc_mult
        if n & (n - 1) or sinkhorn_iters < 1:
            raise ValueError(f"the Triton mHC kernel needs a power-of-two hc_mult and sinkhorn_iters >= 1, got "
                             f"{hc_mult} and {sinkhorn_iters}")
        if logits.dtype != torch.float32 or logits.stride(-1) != 1:
            raise ValueError(f"mHC logits must be fp32 with unit-stride rows, got {logits.dtype}, {logits.stride()}")
        tokens = logits.shape[0]
        pre = torch.empty(tokens, n, dtype=torch.float32, device=logits.device)
        post = torch.empty_like(pre)
        comb = torch.empty(tokens, n, n, dtype=torch.float32, device=logits.device)
        if tokens:
            _mhc_kernel[(triton.cdiv(tokens, BLOCK_T),)](logits, logits.stride(0), pre, post, comb, tokens, eps, N=n,
                                                        ITERS=sinkhorn_iters, BLOCK_T=BLOCK_T)
        return pre, post, comb
