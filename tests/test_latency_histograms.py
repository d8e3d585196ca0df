"""Request latency histograms (``runtime/latency_histograms.py``), what a server's /metrics exports."""

from __future__ import annotations

from deepinfer.outputs import RequestMetrics
from deepinfer.runtime.latency_histograms import TTFT_BOUNDS, Histogram, RequestLatencies


def test_a_value_counts_in_the_first_bucket_at_or_above_it_and_counts_are_cumulative():
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        histogram.observe(value)
    assert histogram.as_dict() == {"le": [0.1, 1.0, float("inf")], "counts": [2, 4, 5], "sum": 4.65, "count": 5}


def test_a_finished_request_gives_each_latency_once_and_a_one_token_request_no_time_per_token():
    latencies = RequestLatencies()
    latencies.observe(RequestMetrics(arrival_time=10.0, first_token_time=10.03, finished_time=11.03,
                                     num_generated_tokens=11))
    latencies.observe(RequestMetrics(arrival_time=20.0, first_token_time=22.0, finished_time=22.0,
                                     num_generated_tokens=1))
    data = latencies.as_dict()
    ttft = data["time_to_first_token_seconds"]
    assert ttft["count"] == 2 and abs(ttft["sum"] - 2.03) < 1e-9
    assert ttft["counts"][TTFT_BOUNDS.index(0.04)] == 1 and ttft["counts"][TTFT_BOUNDS.index(2.5)] == 2
    tpot = data["request_time_per_output_token_seconds"]
    assert tpot["count"] == 1 and abs(tpot["sum"] - 0.1) < 1e-9
    assert data["e2e_request_latency_seconds"]["count"] == 2
    latencies.reset()
    assert all(h["count"] == 0 for h in latencies.as_dict().values())
