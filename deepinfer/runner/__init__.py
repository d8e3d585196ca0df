"""One scheduled step on the device: its inputs built (eagerly or into a CUDA graph), the model run, tokens sampled."""
