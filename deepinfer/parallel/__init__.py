"""Multi-GPU parallelism: expert placement and load balancing."""
