"""The repacked layout of MXFP4 experts that ``moe_mxfp4``'s swap-AB kernel decodes: each layer decided once.

Triton feeds the decoded tile to wgmma as its register operand, and hands ``inline_asm_elementwise`` four of its
elements at a time, from two rows (r, r + 8) and two columns. Each such group's values in a 64-column chunk (four of
the chunk's first 32 columns, group A, and the same four of its last 32, group B) share one 32-bit word, their bits
placed (``WORD_BITS``) so that the kernel's decode needs a few integer ops per register. Decoding multiplies by
``2^(e - 1)`` in bf16, which needs e <= 128 (a scale of at most 2, weights of magnitude at most 12): ``repackable``
refuses other layers, which keep ``moe``'s kernel. The words are laid out as 64-byte lines so that a thread's
16-byte copy holds four of them and ``ldmatrix`` brings them into the operand's registers with no byte moves.

The repack moves bits only within each 16-row block of an expert, keeping the bytes' number: expert parallelism's
moves copy whole experts as before. Tensors carry a mark once repacked (``is_repacked``); the grouped GEMM's
dequantizer reads either layout, and nothing else reads them (a torch reference run on the same tensors afterwards
would read the repacked bytes: the tests copy them first).
"""

from __future__ import annotations

import torch

from deepinfer.logger import init_logger

logger = init_logger(__name__)

CHUNK = 64  # columns per repacked chunk: 32 bytes, eight 32-bit words
MAX_SCALE_EXPONENT = 128  # 2^(e - 1) must be a finite bf16

# Bit position of each (sign, e1, e0, m) of the eight values of a word: A0..A3 sit at the group's operand positions
# (r, 2q), (r, 2q + 1), (r + 8, 2q), (r + 8, 2q + 1) among the chunk's first 32 columns, B0..B3 at the same ones
# among its last 32 (``repack``). Registers: (A0, A1) = q & M, (A2, A3) = (q << 3) & M, (B0, B1) = (q << 6) & M with
# M = 0x81C081C0 (low half: bits 15, 8..6; high half: 31, 24..22), (B2, B3) from the sixteen bits left.
WORD_BITS = {
    "A0": (15, 8, 7, 6), "A1": (31, 24, 23, 22), "A2": (12, 5, 4, 3), "A3": (28, 21, 20, 19),
    "B0": (9, 2, 1, 0), "B1": (25, 18, 17, 16), "B2": (14, 13, 11, 10), "B3": (30, 29, 27, 26),
}
_ORDER = ["A0", "A1", "A2", "A3", "B0", "B1", "B2", "B3"]


def repackable(codes: torch.Tensor, scales: torch.Tensor) -> str | None:
    """Why these packed MXFP4 experts (int8 [E, N, K/2], e8m0 scales [E, N, K/32]) cannot be repacked, or None."""
    if codes.dtype != torch.int8 or codes.dim() != 3:
        return f"codes of dtype {codes.dtype} and {codes.dim()} dims (int8 [E, N, K/2] expected)"
    if (2 * codes.shape[2]) % CHUNK or codes.shape[1] % 16:
        return f"K = {2 * codes.shape[2]} not a multiple of {CHUNK} or N = {codes.shape[1]} not one of 16"
    if not codes.is_contiguous() or not scales.is_contiguous():
        return "non-contiguous codes or scales"
    if codes.numel() and int(scales.view(torch.uint8).max()) > MAX_SCALE_EXPONENT:
        return f"a scale above 2^{MAX_SCALE_EXPONENT - 127} (the folded scale would leave bf16's range)"
    return None


def _codes(codes: torch.Tensor) -> torch.Tensor:
    """Standard packed codes [..., K/2] (low nibble the even column) -> int32 codes [..., K] (0-15)."""
    raw = codes.view(torch.uint8).to(torch.int32)
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """int32 codes [N, K] -> each 16-row block's words [N/16, 8 (r), chunks, 16 (column pair q)] (int64): the values
    of rows r and r + 8, columns 2q and 2q + 1, of the chunk's group A and group B."""
    values = codes.view(codes.shape[0] // 16, 2, 8, -1, CHUNK).to(torch.int64)  # [block, half, r, chunk, column]
    word = torch.zeros(values.shape[:1] + values.shape[2:4] + (16,), dtype=torch.int64, device=codes.device)
    for index, name in enumerate(_ORDER):
        half, column = (index % 4) // 2, index % 2
        code = values[:, half, :, :, (0 if index < 4 else 32) + column::2][..., :16]
        for bit, position in zip((3, 2, 1, 0), WORD_BITS[name]):
            word |= ((code >> bit) & 1) << position
    return word


def _placed(word_bytes: torch.Tensor, rows: int) -> torch.Tensor:
    """[N/16, 8 (r), chunks, 16 (q), 4 (byte)] -> the row-major bytes [N, K/2]: word (r, q)'s bytes are bytes 4q..4q+3
    of a 64-byte line r, which is rows 2r and 2r + 1 of the block's chunk."""
    lines = word_bytes.reshape(word_bytes.shape[0], 8, word_bytes.shape[2], 2, 32)  # [block, r, chunk, row, byte]
    return lines.permute(0, 1, 3, 2, 4).reshape(rows, -1)


def repack(codes: torch.Tensor) -> None:
    """Standard packed MXFP4 codes [E, N, K/2] (int8, N a multiple of 16) -> the repacked layout, in place.

    Triton hands ``inline_asm_elementwise`` four elements of the MMA operand's register layout at a time: rows r and
    r + 8 of a 16-row block, columns 2q and 2q + 1, in the order (r, 2q), (r, 2q + 1), (r + 8, 2q), (r + 8, 2q + 1).
    So each such group's eight values (those four positions of a chunk's group A and group B) make one word, and the
    words are laid out so that one 16-byte load reads four of them: the kernel loads a [BN/2, 64] tile of 64-byte
    lines and reshapes it (``_operand_bytes``) into the operand's [BN, 32] positions, which Triton's layouts make a
    relabelling of registers."""
    for expert in codes:
        word = _words(_codes(expert))
        word_bytes = torch.stack([(word >> (8 * byte)) & 0xFF for byte in range(4)], dim=-1)
        expert.copy_(_placed(word_bytes, expert.shape[0]).to(torch.uint8).view(torch.int8))


def unpack(repacked: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack`` (a new tensor): what tests read."""
    out = torch.empty_like(repacked)
    for expert, target in zip(repacked, out):
        rows = expert.shape[0]
        lines = expert.contiguous().view(torch.uint8).to(torch.int64).view(rows // 16, 8, 2, -1, 32)
        word_bytes = lines.permute(0, 1, 3, 2, 4).reshape(rows // 16, 8, lines.shape[3], 16, 4)
        word = sum(word_bytes[..., byte] << (8 * byte) for byte in range(4))
        values = torch.empty(rows // 16, 2, 8, lines.shape[3], CHUNK, dtype=torch.int64, device=repacked.device)
        for index, name in enumerate(_ORDER):
            code = torch.zeros_like(word)
            for bit, position in zip((3, 2, 1, 0), WORD_BITS[name]):
                code |= ((word >> position) & 1) << bit
            half, column = (index % 4) // 2, index % 2
            first = (0 if index < 4 else 32) + column
            values[:, half, :, :, first:first + 32:2] = code
        flat = values.reshape(rows, -1)
        target.copy_((flat[:, 0::2] | (flat[:, 1::2] << 4)).to(torch.uint8).view(torch.int8))
    return out


# Kept on each codes tensor once its layer is decided: REPACKED, or why the layer stays in the byte layout
LAYOUT_ATTRIBUTE, REPACKED = "_deepinfer_mxfp4_layout", "swap-ab"


def is_repacked(codes: torch.Tensor) -> bool:
    return getattr(codes, LAYOUT_ATTRIBUTE, None) == REPACKED


def prepare(weights) -> str | None:
    """None when the layer's MXFP4 experts are (now) in the repacked layout, else why they stay in the byte layout.
    Decided and logged once per layer, on first sight; the decision stays on the tensors, so later steps (and a
    CUDA-graph capture) never repeat the scale check, which reads the scales on the host."""
    stacks = ((weights.w1, weights.w1_scale), (weights.w3, weights.w3_scale), (weights.w2, weights.w2_scale))
    marks = [getattr(codes, LAYOUT_ATTRIBUTE, None) for codes, _ in stacks]
    if marks[0] is not None and marks.count(marks[0]) == len(marks):
        return None if marks[0] == REPACKED else marks[0]
    if any(mark is not None for mark in marks):
        raise ValueError(f"MXFP4 experts: some of a layer's w1/w3/w2 are repacked and some not ({marks})")
    reason = next((why for codes, scales in stacks if (why := repackable(codes, scales)) is not None), None)
    shape = tuple(weights.w1.shape[1:]), tuple(weights.w2.shape[1:])
    if reason is None:
        for codes, _ in stacks:
            repack(codes)
        logger.info(f"MXFP4 experts {shape}: repacked for the swap-AB kernel (moe_mxfp4)")
    else:
        logger.warning(f"MXFP4 experts {shape}: {reason}; the byte-layout kernel serves them")
    for codes, _ in stacks:
        setattr(codes, LAYOUT_ATTRIBUTE, REPACKED if reason is None else reason)
    return reason
