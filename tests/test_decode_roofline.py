"""``tools/profiling/decode_roofline.py`` on flash4L's config (built on the meta device): its byte counts against counts by
hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from deepinfer.testing.flash_fixtures import write_fixture

_SPEC = importlib.util.spec_from_file_location("decode_roofline",
                                               Path(__file__).resolve().parents[1] / "tools" / "profiling" / "decode_roofline.py")
roofline = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(roofline)


def test_a_step_reads_the_experts_its_routing_touches(tmp_path):
    sizes, config = roofline.tensor_sizes(write_fixture("flash4L", tmp_path))
    layers, experts, top_k = config.num_layers, config.n_routed_experts, config.num_experts_per_tok
    expert = 3 * config.hidden_size * config.moe_intermediate_size * 2  # w1, w3, w2 in bf16
    one, many = roofline.step_bytes(sizes, config, 1), roofline.step_bytes(sizes, config, 1 << 20)
    assert one["routed experts"] == pytest.approx(layers * top_k * expert)
    assert many["routed experts"] == pytest.approx(layers * experts * expert)  # every expert, once
    # the head (and every other dense weight) once a step whatever the batch; the embedding only in its rows
    assert one["other weights"] == many["other weights"] > config.vocab_size * config.hidden_size * 2
    assert one["gathered rows"] == config.hidden_size * 2


def test_expert_parallel_ranks_hold_and_read_their_share_of_the_experts(tmp_path):
    """The full-scale layout: N ranks each hold E/N experts and every other weight, and the N ranks' tokens route
    together, so one rank's experts are touched as a single GPU's would be by N times its batch."""
    sizes, config = roofline.tensor_sizes(write_fixture("flash4L", tmp_path))
    ranks = 8
    alone, shared = roofline.step_bytes(sizes, config, 64 * ranks), roofline.step_bytes(sizes, config, 64, ranks)
    assert shared["routed experts"] == pytest.approx(alone["routed experts"] / ranks)
    assert shared["other weights"] == alone["other weights"]
    assert shared["gathered rows"] == pytest.approx(alone["gathered rows"] / ranks)  # its own 64 tokens' rows
    held, held_alone = roofline.held_bytes(sizes, ranks), roofline.held_bytes(sizes)
    assert held["routed experts"] == pytest.approx(held_alone["routed experts"] / ranks)
    assert held["other weights"] == held_alone["other weights"] > 0
