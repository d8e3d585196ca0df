"""DeepSeek-V4.1's vision encoder: a full-attention ViT with 2D RoPE, then a merger into the text width.

One image at a time: its ``rows x cols`` RGB patches (``image_processing.py``) pass through ``VisionTower``, then
``Merger`` concatenates each ``ratio x ratio`` cell of patch states (the grid zero-padded to whole cells) and
projects it through a GELU MLP to one text-width image token. ``VisionEncoder`` holds both plus the three learned
delimiters the image span places around them, under the released checkpoint's names (``vision.*``, ``aligner.*``,
``image_{start,end,newline}``), so its ``state_dict`` is the checkpoint's vision part as it is.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.deepseek_v4.layers import RMSNorm
from deepinfer.models.deepseek_v41.config import VisionConfig

# the release's vision norms (not configurable there)
NORM_EPS = 1e-6

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q, k, v [P, H, D] -> [P, H * D]


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full bidirectional attention over one image's patches: q, k, v [patches, heads, head_dim] (RoPE applied)
    -> [patches, heads * head_dim], softmax scale head_dim^-0.5.

    The torch reference; the engine's tower calls its ``VisionAttentionBackend`` (``attention``).
    """
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    return out.transpose(0, 1).flatten(1)


def rotary_angles(rows: int, cols: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[rows * cols, head_dim / 2] angles of the 2D RoPE, patches row-major: the first half of the frequencies
    turn with the patch's row, the second half with its column (fp32, as the release computes them)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=device) / (2 * quarter))
    row = torch.arange(rows, device=device).repeat_interleave(cols).float()
    col = torch.arange(cols, device=device).repeat(rows).float()
    return torch.cat([row[:, None] * inv_freq, col[:, None] * inv_freq], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [patches, heads, head_dim] rotated pairwise (channel i with i + head_dim/2) in fp32; cos, sin
    [patches, 1, head_dim / 2]."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(3 * c.patch_size**2, c.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig, attend: Attend):
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.wo = nn.Linear(c.hidden_size, c.hidden_size)
        self.attend = attend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return self.wo(self.attend(rotate(q, cos, sin), rotate(k, cos, sin), v))


class VisionMLP(nn.Module):
    """SwiGLU without biases; ``w1`` holds the gate rows, then the up rows."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.w2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig, attend: Attend):
        super().__init__()
        self.norm1 = RMSNorm(c.hidden_size, NORM_EPS)
        self.attn = VisionAttention(c, attend)
        self.norm2 = RMSNorm(c.hidden_size, NORM_EPS)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    def __init__(self, c: VisionConfig, attend: Attend = vision_attention):
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c, attend) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, NORM_EPS)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """patches [rows * cols, 3, patch, patch] (row-major) -> patch states [rows * cols, vision hidden]."""
        x = self.patch_embed(patches)
        angles = rotary_angles(rows, cols, self.config.head_dim, self.config.rope_theta, x.device)[:, None]
        cos, sin = angles.cos(), angles.sin()
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


def merge_cells(states: torch.Tensor, rows: int, cols: int, ratio: int) -> torch.Tensor:
    """Patch states [rows * cols, C] -> one vector per ``ratio x ratio`` cell, [cells, C * ratio^2], cells
    row-major. The grid is zero-padded at the bottom and right to whole cells; a cell's vector is ordered by
    channel, then row and column inside the cell (the order the release's weights expect)."""
    grid = F.pad(states.view(rows, cols, -1), (0, 0, 0, -cols % ratio, 0, -rows % ratio))
    cell_rows, cell_cols = grid.shape[0] // ratio, grid.shape[1] // ratio
    cells = grid.view(cell_rows, ratio, cell_cols, ratio, -1).permute(0, 2, 4, 1, 3)
    return cells.reshape(cell_rows * cell_cols, -1)


class Merger(nn.Module):
    """Cells of patch states -> text-width image tokens (the checkpoint's ``aligner``)."""

    def __init__(self, c: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.ratio = c.downsample_ratio
        self.w1 = nn.Linear(c.hidden_size * self.ratio**2, text_hidden_size)
        self.w2 = nn.Linear(text_hidden_size, text_hidden_size)

    def forward(self, states: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(merge_cells(states, rows, cols, self.ratio))))


class VisionEncoder(nn.Module):
    """Image patches -> the text-width embeddings of the image's tokens; parameters under the released names.

    Projections and delimiters are held in ``dtype``; the norms' weights stay fp32, as the release ships them.
    ``attend`` is the tower's attention (a ``VisionAttentionBackend``'s ``attention``; the reference by default).
    """

    def __init__(self, c: VisionConfig, text_hidden_size: int, dtype: torch.dtype = torch.bfloat16,
                 attend: Attend = vision_attention):
        super().__init__()
        self.config = c
        self.vision = VisionTower(c, attend)
        self.aligner = Merger(c, text_hidden_size)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.to(dtype)
        self.image_start = nn.Parameter(torch.zeros(text_hidden_size, dtype=dtype))
        self.image_end = nn.Parameter(torch.zeros(text_hidden_size, dtype=dtype))
        self.image_newline = nn.Parameter(torch.zeros(text_hidden_size, dtype=dtype))
        self.requires_grad_(False)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """patches [rows * cols, 3, patch, patch] of one image, ``rows x cols`` ViT patches -> its image tokens
        [ceil(rows / ratio) * ceil(cols / ratio), text hidden], row-major."""
        if patches.shape[0] != rows * cols:
            raise ValueError(f"a {rows}x{cols} patch grid needs {rows * cols} patches; got {patches.shape[0]}")
        dtype = self.aligner.w1.weight.dtype
        return self.aligner(self.vision(patches.to(dtype), rows, cols), rows, cols)

    def span_embeddings(self, tokens: torch.Tensor, token_rows: int, token_cols: int) -> torch.Tensor:
        """The embeddings of the whole image span, in prompt order: start, each row of image tokens followed by
        a row end, end. ``tokens`` [token_rows * token_cols, hidden] (``forward``'s output)."""
        hidden = tokens.shape[-1]
        newline = self.image_newline.to(tokens.dtype).expand(token_rows, 1, hidden)
        lines = torch.cat([tokens.view(token_rows, token_cols, hidden), newline], dim=1).flatten(0, 1)
        ends = [self.image_start.to(tokens.dtype)[None], self.image_end.to(tokens.dtype)[None]]
        return torch.cat([ends[0], lines, ends[1]])
