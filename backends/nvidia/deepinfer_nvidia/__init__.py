"""DeepInfer's NVIDIA backend plugin (``deepinfer_nvidia.plugin``); kernels are imported only on CUDA devices."""

import os

# Triton's interpreter runs the kernels (the CPU tests): it cannot time tile configurations, and has no bf16 or fp8
# arithmetic, so the launchers pick small tiles and fp32 paths under it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
