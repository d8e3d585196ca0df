"""``deepinfer bench serve`` on the embedded model: a tiny sweep, vllm bench serve's JSON keys, the counts."""

import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from deepinfer.cli import main  # noqa: E402

KEYS = {"request_throughput", "output_throughput", "total_token_throughput", "completed", "failed", "duration",
        "total_input_tokens", "total_output_tokens", "max_concurrency", "request_rate", "num_prompts"}
KEYS |= {f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p99") for name in ("ttft", "tpot", "itl", "e2el")}


def test_a_small_sweep_reports_vllm_keys(tmp_path, capsys):
    main(["bench", "serve", "--model", "deepinfer-tiny-v4.1", "--num-prompts", "4", "--random-input-len", "300",
          "--random-output-len", "4", "--ignore-eos", "--max-concurrency", "1", "4", "--save-result",
          "--result-dir", str(tmp_path)])
    assert capsys.readouterr().out.count("Serving Benchmark Result") == 2
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("*.json")), key=lambda r: r["max_concurrency"])
    assert [r["max_concurrency"] for r in results] == [1, 4]
    for result in results:
        assert KEYS <= set(result)
        assert result["completed"] == 4 and result["failed"] == 0 and result["request_rate"] == "inf"
        assert result["total_input_tokens"] == 4 * 300 and result["total_output_tokens"] == 4 * 4
        assert result["output_throughput"] == pytest.approx(16 / result["duration"])
        assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["mean_tpot_ms"] > 0
        # the server's engine during the timed run (its /metrics): 4 tokens a request take at least 4 steps; a CPU
        # captures no CUDA graph and builds no Triton kernel; no run's prompt was in the prefix cache (each run and
        # warm-up draws its own: 300 tokens would share a cached 256)
        assert result["engine_steps"] >= 4 and result["graph_captures"] == result["kernel_compiles"] == 0
        assert result["cached_prompt_tokens"] == 0


def test_bad_flags_are_refused_naming_them(capsys):
    for flags, named in ([["--request-rate", "0"], "--request-rate"], [["--max-concurrency", "0"], "--max-concurrency"],
                         [["--max-concurrency", "1", "2", "--result-filename", "x.json"], "--result-filename"]):
        with pytest.raises(SystemExit) as exit:
            main(["bench", "serve", "--model", "deepinfer-tiny-v4.1", *flags])
        assert exit.value.code == 2 and named in capsys.readouterr().err


def test_a_server_that_cannot_start_is_named_with_its_reason():
    # the server runs in a child process: its refusal comes back to the parent as the error
    with pytest.raises(RuntimeError, match="did not start.*--max-queued must be >= 1"):
        main(["bench", "serve", "--model", "deepinfer-tiny-v4.1", "--num-prompts", "1", "--max-queued", "0"])
