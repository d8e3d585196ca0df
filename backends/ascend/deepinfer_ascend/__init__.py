"""DeepInfer's Ascend backend plugin (``deepinfer_ascend.plugin``); torch_npu is imported only for NPU devices."""
