"""DeepInfer's NVIDIA backend plugin (``deepinfer_nvidia.plugin``); kernels are imported only on CUDA devices."""
