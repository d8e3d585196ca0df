"""``deepinfer bench <kind>``: one module per kind (``throughput`` also serves ``latency`` and the options they share)."""
