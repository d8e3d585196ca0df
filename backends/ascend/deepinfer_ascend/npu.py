"""torch_npu, imported only when an NPU is asked for, and where this backend's facts about it come from.

Sources (nothing here was run on Ascend hardware):

* signatures: the schemas registered in the torch_npu 2.13.0 wheel (``libtorch_npu.so``, the version matching
  torch 2.13.0); every keyword this package passes exists there;
* semantics and products: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/*.md`` and the CPU goldens in
  ``test/test_custom_ops/*.py`` at commit 517f2e7 (2026-08-21) ("950: in tests": the doc lists A2/A3, op-plugin's
  tests of the operator also name the Ascend 950);
* CANN: no document read states the CANN version an operator needs. torch_npu 2.13.0's README tables stop at
  CANN 8.5.0 (torch 2.12); vllm-ascend pairs CANN 9.1.0 with torch_npu 2.10.0.post4 for the Ascend 950. Nothing
  public was found about CANN 9.2, the spec's version.

=====================================  ===================================================  ======================
operator                               used for                                             products in its doc
=====================================  ===================================================  ======================
npu_sparse_flash_attention             sparse MQA with sinks (``sinks`` needs the 950)      950PR/950DT, A2/A3
npu_moe_init_routing_v2                expert-major token order and per-expert counts       A2/A3 (950 not listed)
npu_grouped_matmul                     the experts' w1|w3 and w2 products                   A2/A3 (950 not listed)
npu_clipped_swiglu                     clamped SwiGLU (alpha 1, bias 0, halves)             A2/A3 (950 not listed)
npu_mhc_sinkhorn                       hyper-connection Sinkhorn                            950PR/950DT
npu_mhc_post                           hyper-connection expansion                           950PR/950DT
npu_moe_distribute_dispatch_v2         expert parallelism: tokens to their experts' ranks   A2/A3 (950: in tests)
npu_moe_distribute_combine_v2          expert parallelism: weighted rows back, summed       A2/A3 (950: in tests)
=====================================  ===================================================  ======================
"""

from __future__ import annotations

from types import ModuleType


def torch_npu() -> ModuleType | None:
    """The torch_npu module (importing it registers the ``npu`` device with torch), or None when not installed.

    Only an ImportError means "not installed": a torch_npu that fails otherwise (a CANN mismatch) must say so.
    """
    try:
        import torch_npu as module
    except ImportError:
        return None
    return module


def has_npu(module: ModuleType) -> bool:
    """Whether torch_npu sees at least one NPU."""
    return bool(module.npu.is_available()) and module.npu.device_count() > 0
