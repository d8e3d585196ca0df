"""Hook implementations: each answers only for NPU devices with torch_npu importable; elsewhere it declines (returns
None) and the built-in torch reference plugins serve.

Served: attention (``AscendAttention``), routed experts (``AscendMoE``), hyper-connections (``AscendMHC``), and
expert parallelism's token exchange (``AscendExchange``: ``npu_moe_distribute_dispatch_v2``/``combine_v2``).
Left to the reference, on purpose: linear layers (no documented torch_npu operator multiplies e4m3 weights with
UE8M0 tile scales on the 950; ``npu_quant_matmul``'s docs cover int8/int4) and the sampler
(``npu_top_k_top_p_sample`` draws from a torch generator, while the hook's seeded rows draw from (seed, position,
token) alone, and the hook also applies penalties and returns logprobs). ``AscendMoE.route`` (MoE gating) runs the
torch reference: ``npu_moe_gating_top_k`` has no sqrt-softplus scoring, V4's router (see the README).

With ``DEEPINFER_BATCH_INVARIANT=1`` every hook declines: no operator here is established as batch-invariant.
"""

from __future__ import annotations

import logging
from types import ModuleType

from deepinfer.logger import init_logger, log_once
from deepinfer.plugins import hookimpl
from deepinfer_ascend import npu
from deepinfer_ascend.attention import AscendAttention
from deepinfer_ascend.exchange import MAX_BS, AscendExchange
from deepinfer_ascend.mhc import AscendMHC
from deepinfer_ascend.moe import AscendMoE

logger = init_logger(__name__)

# Asked before feature plugins (manager.PRIORITY_ATTRIBUTE), as every device plugin is
DEEPINFER_PRIORITY = 10


def _serving(config, device) -> ModuleType | None:
    """torch_npu when this plugin serves ``device``, else None (the hook declines)."""
    if getattr(device, "type", None) != "npu":
        return None
    if config.batch_invariant:
        log_once(logger, logging.INFO, "batch-invariant mode: the Ascend plugin declines (its operators are not "
                                       "established as batch-invariant)")
        return None
    module = npu.torch_npu()
    if module is None:
        log_once(logger, logging.WARNING, "device is an NPU but torch_npu is not importable: the Ascend plugin "
                                          "declines and the torch reference serves every hook")
    return module


@hookimpl
def deepinfer_configure_engine(config):
    # torch.device("npu") parses only once torch_npu is imported, and the engine builds its device after this hook
    if not str(config.device).startswith("npu"):
        return
    module = npu.torch_npu()
    if module is None:
        raise ValueError(f"device={config.device!r} needs torch_npu (DEEPINFER_ACCELERATOR=ascend ./build.sh "
                         "installs the one matching torch)")
    if not npu.has_npu(module):
        raise ValueError(f"device={config.device!r}, but torch_npu sees no NPU (is CANN's set_env.sh sourced?)")


def _backend(config, device, backend_class):
    module = _serving(config, device)
    return None if module is None else backend_class(module)


@hookimpl
def deepinfer_attention_backend(config, device):
    return _backend(config, device, AscendAttention)


@hookimpl
def deepinfer_moe_backend(config, device):
    return _backend(config, device, AscendMoE)


@hookimpl
def deepinfer_mhc_backend(config, device):
    return _backend(config, device, AscendMHC)


@hookimpl
def deepinfer_token_exchange(config, ranks):
    """Expert parallelism on NPUs: the MC2 operators, on a HCCL group of their own (created here, on every rank).
    Calls outside their documented limits (``exchange.exchange_unsupported``: bf16/fp16, hidden 1024-7168, k <= 16,
    <= 1024 slots, the listed EP world sizes) go to the torch all-to-all, logged; at most 256 tokens per rank go in
    one call (fewer when HCCL_BUFFSIZE is below the documented buffer), more take several."""
    module = _serving(config, ranks.device)
    if module is None:
        return None
    missing = [op for op in ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")
               if not hasattr(module, op)]
    if missing:
        log_once(logger, logging.WARNING, f"torch_npu has no {', '.join(missing)}: the torch all-to-all exchanges "
                                          "expert parallelism's tokens")
        return None
    log_once(logger, logging.INFO, "expert-parallel token exchange: npu_moe_distribute_dispatch_v2 / "
                                   f"npu_moe_distribute_combine_v2 (bf16/fp16, up to {MAX_BS} tokens per rank and "
                                   "call), the torch all-to-all outside their documented limits")
    return AscendExchange.for_ranks(module, ranks)
