"""From a checkpoint to tensors: finding the model, reading its shards, planning the weights, the tokenizer; and
writing checkpoints in DeepSeek's release format (``convert``)."""
