"""DeepSeek-V4.1 (V4.1-Flash): CSA2 attention with shared KV sources, Engram and single-pass mHC."""
