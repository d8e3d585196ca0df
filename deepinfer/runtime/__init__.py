"""What the engine, the model and the backends share: requests and the scheduler's batch, caches and their formats,
slots, kernels' reference ops, quantized linears, devices."""
