"""The ``deepinfer`` command: generate, chat (on standard input and in a pseudo-terminal), plugins, env and the help
texts (bench has tests/test_bench.py)."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams, envs
from deepinfer.cli import main
from deepinfer.plugins.manager import DEFAULT_PLUGINS

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
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", EMBEDDED])
    assert exit_.value.code == 2 and "give prompts" in capsys.readouterr().err


def _error_line(capsys, argv) -> str:
    """What a user error prints: exit 2, one line on standard error, no traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()  # after the loading bar, where a model was loaded
    assert exit_.value.code == 2 and "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("deepinfer: error: ") and err.count("deepinfer: error: ") == 1
    return last


@pytest.mark.parametrize("argv, says", [
    (["generate", "--model", "/no/such/dir", "hi"], "/no/such/dir"),
    (["generate", "--model", EMBEDDED, "--temperature", "-1", "hi"], "temperature"),
    (["generate", "--model", EMBEDDED, "--max-model-len", "8", "a prompt far longer than eight tokens, surely"],
     "max_model_len"),
    (["generate", "--model", EMBEDDED, "--device", "tpu", "hi"], "tpu"),
    (["bench", "latency", "--model", "/no/such/dir"], "/no/such/dir"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, argv, says):
    assert says in _error_line(capsys, argv)


@pytest.mark.skipif(__import__("torch").version.cuda is not None, reason="a CPU build of torch")
def test_cuda_on_a_cpu_build_of_torch_is_refused_before_loading(capsys, monkeypatch):
    # our sentence, not torch's "Torch not compiled with CUDA enabled" from the first allocation on the device
    assert "build without CUDA" in _error_line(capsys, ["generate", "--model", EMBEDDED, "--device", "cuda", "x"])
    from deepinfer.runtime.devices import DeviceUnavailable

    with pytest.raises(DeviceUnavailable, match="build without CUDA"):  # the API takes the same check
        LLM(EMBEDDED, device="cuda:1")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    envs.reload()
    assert "DEEPINFER_ACCELERATOR=nvidia" in _error_line(capsys, ["generate", "--model", EMBEDDED, "x"])


def test_debug_shows_the_traceback(monkeypatch):
    with pytest.raises(FileNotFoundError):
        main(["--debug", "generate", "--model", "/no/such/dir", "hi"])
    with pytest.raises(FileNotFoundError):
        main(["generate", "--model", "/no/such/dir", "hi", "--debug"])
    monkeypatch.setenv("DEEPINFER_LOGGING_LEVEL", "DEBUG")
    envs.reload()
    with pytest.raises(FileNotFoundError):
        main(["generate", "--model", "/no/such/dir", "hi"])


def test_ctrl_c_ends_with_130_and_no_traceback(capsys, monkeypatch):
    from deepinfer.cli import commands as cli_commands

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_commands, "run_generate", interrupted)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi"])
    assert exit_.value.code == 130 and capsys.readouterr().err.strip() == "deepinfer: interrupted"


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
    assert any(line.startswith("deepinfer.plugins.builtin.torch_exchange ")
               and line.endswith(": deepinfer_token_exchange") for line in lines)
    assert sum("deepinfer.plugins.builtin." in line for line in lines) == len(DEFAULT_PLUGINS)


@pytest.mark.parametrize("argv", [[], ["generate"], ["plugins"], ["env"], ["bench"], ["bench", "latency"]])
def test_help_texts(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: deepinfer")
    if not argv:
        assert all(command in out for command in ("generate", "plugins", "env", "bench"))


CHAT_FLAGS = ["--model", EMBEDDED, "--dtype", "float32", "--temperature", "0", "--max-tokens", "4", "--system",
              "Python only."]


@pytest.fixture(scope="module")
def chat_answers() -> tuple[str, str]:
    """The greedy answers to "Write a function", then "And a class" after the first answer (CHAT_FLAGS)."""
    llm, greedy = LLM(EMBEDDED, dtype="float32"), SamplingParams(temperature=0, max_tokens=4)
    history = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "Write a function"}]
    first = llm.chat(history, greedy, use_tqdm=False)[0].outputs[0].text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And a class"}]
    return first, llm.chat(history, greedy, use_tqdm=False)[0].outputs[0].text


def test_chat_streams_two_turns_with_the_history(capsys, monkeypatch, chat_answers):
    """Each line is a user turn; the second is encoded after the first answer; /exit ends before the last line."""
    monkeypatch.setattr("sys.stdin", io.StringIO("Write a function\nAnd a class\n/exit\nnever read\n"))
    main(["chat", *CHAT_FLAGS])
    first, second = chat_answers
    assert capsys.readouterr().out == first + "\n" + second + "\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="drives the command through a Linux pseudo-terminal")
def test_chat_in_a_terminal_answers_each_turn_before_the_next_is_typed(tmp_path, chat_answers):
    """``deepinfer chat`` in a pseudo-terminal: it prompts with '> ', each answer is streamed back before the next
    line is typed (the terminal echoes what is typed), and /exit ends it with status 0. 150 s at most: never hangs."""
    import pty

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    master, slave = pty.openpty()
    with open(tmp_path / "stderr.txt", "wb") as stderr:
        child = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "chat", *CHAT_FLAGS], stdin=slave,
                                 stdout=slave, stderr=stderr, cwd=root, env=env, start_new_session=True)
    os.close(slave)
    deadline, screen = time.monotonic() + 150, b""

    def shown() -> str:  # the terminal turns each newline into \r\n
        return screen.decode("utf-8", errors="replace").replace("\r\n", "\n")

    def read_until(expected: str) -> None:
        nonlocal screen
        while not shown().endswith(expected):
            left = deadline - time.monotonic()
            assert left > 0, f"waited for {expected!r}; the terminal shows {shown()!r}; stderr: " \
                             f"{(tmp_path / 'stderr.txt').read_text(errors='replace')[-2000:]}"
            if select.select([master], [], [], min(left, 1.0))[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the command closed the terminal
                    chunk = b""
                assert chunk or child.poll() is None, f"the command ended early: {shown()!r}"
                screen += chunk

    try:
        first, second = chat_answers
        read_until("> ")
        os.write(master, b"Write a function\n")
        read_until(f"> Write a function\n{first}\n> ")
        os.write(master, b"And a class\n")
        read_until(f"> Write a function\n{first}\n> And a class\n{second}\n> ")
        os.write(master, b"/exit\n")
        assert child.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(master)
