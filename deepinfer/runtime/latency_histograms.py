"""Finished requests' latencies as histograms, for a server's ``/metrics``: time to the first token, the mean time
per output token after it, and the whole request. Bucket bounds are vLLM's, so dashboards built for its
``vllm:*_seconds`` histograms read these too."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from deepinfer.outputs import RequestMetrics

TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0, 160.0, 640.0, 2560.0)
TPOT_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
              960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Histogram:
    """Observations counted in the buckets ``value <= bound`` (the first such bound; past the last: +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def as_dict(self) -> dict:
        """Prometheus' view: cumulative counts by upper bound (+Inf last), the sum and the count."""
        cumulative, running = [], 0
        for count in self.counts:
            running += count
            cumulative.append(running)
        return {"le": [*self.bounds, float("inf")], "counts": cumulative, "sum": self.total, "count": running}


class RequestLatencies:
    """One histogram each: ``time_to_first_token_seconds``, ``request_time_per_output_token_seconds`` (requests of
    two tokens or more) and ``e2e_request_latency_seconds``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.histograms = {"time_to_first_token_seconds": Histogram(TTFT_BOUNDS),
                           "request_time_per_output_token_seconds": Histogram(TPOT_BOUNDS),
                           "e2e_request_latency_seconds": Histogram(E2E_BOUNDS)}

    def observe(self, metrics: RequestMetrics) -> None:
        """A finished request's times (a request that produced no token has none)."""
        values = {"time_to_first_token_seconds": metrics.time_to_first_token,
                  "request_time_per_output_token_seconds": metrics.time_per_output_token,
                  "e2e_request_latency_seconds": None if metrics.finished_time is None
                  else metrics.finished_time - metrics.arrival_time}
        for name, value in values.items():
            if value is not None:
                self.histograms[name].observe(value)

    def as_dict(self) -> dict[str, dict]:
        return {name: histogram.as_dict() for name, histogram in self.histograms.items()}
