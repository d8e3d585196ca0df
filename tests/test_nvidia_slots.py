"""The NVIDIA backend's padded-step slot kernels against ``deepinfer.runtime.slots.padded_slots`` (natively on a GPU,
else Triton's interpreter), on random block tables and positions, including padded rows, unclosed windows, positions
before the first block and tables narrower than a position's block."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runner.step_inputs import StepInputs  # noqa: E402
from deepinfer.runtime.slots import SlotLayout, padded_slots  # noqa: E402
from deepinfer_nvidia.slots import padded_slots as triton_padded_slots  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16


def _inputs(layout: SlotLayout, tokens: int, requests: int, blocks: int, candidates: dict[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    tables = {}
    for kind, rows in layout.rows_per_block.items():
        table = torch.randperm(4 * requests * blocks, generator=g)[: requests * blocks].view(requests, blocks)
        holes = torch.rand(requests, blocks, generator=g) < 0.15  # blocks a request no longer (or never) holds
        table[holes] = -1
        table[0, :3] = torch.arange(3) + 4 * requests * blocks  # request 0 holds its first blocks
        table[-1] = -1  # a padded request: no blocks at all
        tables[kind] = table
    positions = torch.randint(0, BLOCK * blocks + 5, (tokens,), generator=g)  # some past the table's width
    positions[1:4] = torch.tensor([0, 3, 7])[: max(0, min(tokens, 4) - 1)]  # windows reaching before position 0
    owner = torch.randint(0, requests, (tokens,), generator=g)
    owner[0], positions[0] = 0, 2 * BLOCK + 7  # a token whose window lies in blocks it holds
    return StepInputs(token_ids=torch.zeros(tokens, dtype=torch.int64), positions=positions,
                      owner=owner, logits_rows=torch.arange(tokens),
                      tables=tables, close_tokens={}, extras={}, candidates=candidates,
                      scratch_rows={kind: 1000 + i for i, kind in enumerate(layout.rows_per_block)}).to(DEVICE)


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("overlaps", [{4: 2, 8: 1}, {2: 0, 4: 1}])
def test_padded_slots_match_the_reference(tokens, overlaps):
    rows = {"swa": BLOCK}
    for ratio, overlap in overlaps.items():
        rows[f"comp{ratio}"] = BLOCK // ratio
        if overlap:
            rows[f"state{ratio}"] = BLOCK // ratio * overlap if ratio * overlap <= BLOCK else 1
    layout = SlotLayout(window=12, block_size=BLOCK, rows_per_block=rows, overlaps=overlaps)
    # one ratio's candidates span several kernel chunks (BLOCK_CANDIDATES = 256)
    inputs = _inputs(layout, tokens, requests=4, blocks=9, candidates={r: 300 // r for r in overlaps}, seed=tokens)
    if DEVICE.type == "cuda":
        torch.full((1 << 24,), -7, dtype=torch.int64, device=DEVICE)  # freed at once: outputs reuse poisoned memory
    ours, reference = triton_padded_slots(layout, inputs), padded_slots(layout, inputs)
    torch.testing.assert_close(ours.window, reference.window, rtol=0, atol=0)
    torch.testing.assert_close(ours.swa_slots, reference.swa_slots, rtol=0, atol=0)
    assert ours.compressed.keys() == reference.compressed.keys()
    for ratio in overlaps:
        for name, a, b in zip(("state_slots", "candidates", "close_rows", "close_slots", "close_positions"),
                              ours.compressed[ratio], reference.compressed[ratio]):
            assert a.shape == b.shape, (ratio, name)
            assert torch.equal(a, b), (ratio, name)
    assert (reference.window >= 0).any() and ((reference.window < 0).any() or tokens == 1)  # both cases exercised


def test_a_non_power_of_two_block_size_is_refused():
    layout = SlotLayout(window=4, block_size=12, rows_per_block={"swa": 12}, overlaps={})
    inputs = StepInputs(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                        torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                        {"swa": torch.zeros(1, 1, dtype=torch.int64)}, {}, {}, {}, {"swa": 5}).to(DEVICE)
    with pytest.raises(ValueError, match="power-of-two block size"):
        triton_padded_slots(layout, inputs)
