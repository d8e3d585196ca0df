"""DeepInfer's speculative-decoding drafters (the ``deepinfer_drafter`` hook): DSpark for DeepSeek-V4.1."""
