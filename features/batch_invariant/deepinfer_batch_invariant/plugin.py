"""``DEEPINFER_BATCH_INVARIANT=1``: every step runs inside ``FixedRowTiles`` (``deepinfer_step_context``), and
combinations whose results would still depend on the batch are refused at start-up (``deepinfer_configure_engine``).

Attention is served by ``BlockedTorchAttention`` wherever the reference would serve it (a padded index list
changes nothing). What the rest of the engine already guarantees, and this mode relies on: a query's index list
is in an order that does not depend on batch mates; the indexer's top-k breaks ties by candidate order (a stable
sort); the sampler's ``seq_seed`` noise is a function of (seed, output position, token id).
"""

from __future__ import annotations

from deepinfer.plugins.hookspecs import hookimpl
from deepinfer_batch_invariant import cpu_checks
from deepinfer_batch_invariant.attention import BlockedTorchAttention
from deepinfer_batch_invariant.fixed_tiles import FixedRowTiles

# Rows per tile. The whole decode batch of a small step fits one tile; a larger tile wastes more padding there but
# makes fewer calls in a long prefill.
TILE_ROWS = {"cpu": 16, "cuda": 64}


def _refusals(config) -> list[str]:
    refusals = []
    if config.enable_mtp_varlen:
        refusals.append(
            "DEEPINFER_ENABLE_MTP_VARLEN=1 schedules each request's draft length from the step's load, so what a "
            "request verifies depends on its batch mates; use DEEPINFER_ENABLE_MTP_VARLEN=0 (fixed length)"
        )
    return refusals


@hookimpl
def deepinfer_configure_engine(config):
    if not config.batch_invariant:
        return
    refusals = _refusals(config)
    if refusals:
        raise ValueError("DEEPINFER_BATCH_INVARIANT=1 cannot hold with these settings: " + "; ".join(refusals))


@hookimpl
def deepinfer_step_context(config, device):
    if not config.batch_invariant:
        return None
    if device.type not in TILE_ROWS:
        raise ValueError(f"DEEPINFER_BATCH_INVARIANT=1 has no fixed tiling for {device.type} devices "
                         f"(supported: {', '.join(TILE_ROWS)})")
    on_cpu = device.type == "cpu"
    problems = cpu_checks.cpu_problems(TILE_ROWS["cpu"]) if on_cpu else []
    if problems:
        raise ValueError("DEEPINFER_BATCH_INVARIANT=1 cannot hold on this CPU: " + "; ".join(problems))
    return FixedRowTiles(TILE_ROWS[device.type], tile_reductions=True, exact_tails=on_cpu)


@hookimpl
def deepinfer_attention_backend(config, device):
    """Asked before the built-in reference (and after device plugins, which serve their own invariant kernels)."""
    return BlockedTorchAttention() if config.batch_invariant else None
