"""The ``deepinfer`` command: generate, plugins, env and the help texts (bench has tests/test_bench.py)."""

from __future__ import annotations

import io
import json

import pytest

from deepinfer import LLM, SamplingParams, envs
from deepinfer.cli import main

EMBEDDED = "deepinfer-tiny-v4.1"


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line]


def test_generate_prints_what_the_api_generates(capsys, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("import os\\nimport sys\n\ndef add(a, b):\n")  # a literal \n in a line is a newline
    main(["generate", "--model", EMBEDDED, "--max-tokens", "6", "--json", "--logprobs", "1", "--prompts-file",
          str(prompts_file), "class Stack:"])
    printed = [json.loads(line) for line in _lines(capsys)]
    prompts = ["class Stack:", "import os\nimport sys", "def add(a, b):"]
    expected = LLM(EMBEDDED).generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
    assert [p["prompt"] for p in printed] == prompts
    for ours, theirs in zip(printed, expected):
        completion = ours["outputs"][0]
        assert completion["token_ids"] == theirs.outputs[0].token_ids and completion["text"] == theirs.outputs[0].text
        assert len(completion["logprobs"]) == 6 and completion["finish_reason"] == "length"


def test_generate_prints_text_and_needs_prompts(capsys):
    main(["generate", "--model", EMBEDDED, "--max-tokens", "3", "--n", "2", "--temperature", "1", "--seq-seed", "3",
          "x = "])
    lines = _lines(capsys)
    assert lines[0].startswith("x = ") and lines.count("--- length, 3 tokens") == 2
    with pytest.raises(SystemExit, match="give prompts"):
        main(["generate", "--model", EMBEDDED])


def test_env_lists_every_variable_with_where_its_value_comes_from(capsys, monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    envs.reload()
    main(["env"])
    lines = _lines(capsys)
    assert [line.split("=", 1)[0] for line in lines] == [v.name for v in envs.VARIABLES]
    assert "DEEPINFER_USE_NEXTN_DECODE=3 (set; int >= 1)" in lines[[v.name for v in envs.VARIABLES].index(
        "DEEPINFER_USE_NEXTN_DECODE")].replace("≥", ">=")
    assert any(line.startswith("DEEPINFER_ASYNC_SCHEDULING=1 (default; bool)") for line in lines)


def test_plugins_lists_the_builtins_and_their_hooks(capsys):
    main(["plugins"])
    lines = _lines(capsys)
    assert any(line.startswith("deepinfer.plugins.builtin.torch_sampler ") and line.endswith(": deepinfer_sampler")
               for line in lines)
    assert sum("deepinfer.plugins.builtin." in line for line in lines) == 5


@pytest.mark.parametrize("argv", [[], ["generate"], ["plugins"], ["env"], ["bench"], ["bench", "latency"]])
def test_help_texts(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: deepinfer")
    if not argv:
        assert all(command in out for command in ("generate", "plugins", "env", "bench"))


def test_chat_streams_two_turns_with_the_history(capsys, monkeypatch):
    """Each line is a user turn; the second is encoded after the first answer; /exit ends before the last line."""
    monkeypatch.setattr("sys.stdin", io.StringIO("Write a function\nAnd a class\n/exit\nnever read\n"))
    main(["chat", "--model", EMBEDDED, "--dtype", "float32", "--temperature", "0", "--max-tokens", "8", "--system",
          "Python only."])
    printed = capsys.readouterr().out
    llm, greedy = LLM(EMBEDDED, dtype="float32"), SamplingParams(temperature=0, max_tokens=8)
    history = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "Write a function"}]
    first = llm.chat(history, greedy, use_tqdm=False)[0].outputs[0].text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And a class"}]
    second = llm.chat(history, greedy, use_tqdm=False)[0].outputs[0].text
    assert printed == first + "\n" + second + "\n"
