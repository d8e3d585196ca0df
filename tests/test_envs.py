import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import envs

EXPECTED_DEFAULTS = {
    "DEEPINFER_ACCELERATOR": "auto",
    "DEEPINFER_KERNELS": "auto",
    "DEEPINFER_HF_MODEL_DIR": None,
    "DEEPINFER_PLUGINS": None,
    "DEEPINFER_ENABLE_MTP_VARLEN": None,
    "DEEPINFER_SPECULATION_POLICY": "measured",
    "DEEPINFER_USE_NEXTN_DECODE": 5,
    "DEEPINFER_DRAFT_VOCAB": None,
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "off",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": 140,
    "DEEPINFER_BATCH_INVARIANT": False,
    "DEEPINFER_ASYNC_SCHEDULING": True,
    "DEEPINFER_DEPENDENT_LAUNCH": True,
    "DEEPINFER_ENGRAM_TABLES": "auto",
    "DEEPINFER_LOGGING_LEVEL": "INFO",
    "DEEPINFER_TRACE_PLUGINS": False,
}


@pytest.fixture
def clean_environ(monkeypatch):
    """No DEEPINFER_* variable set, whatever the shell running the tests exports."""
    for name in list(os.environ):
        if name.startswith(envs.PREFIX):
            monkeypatch.delenv(name)


def test_registry_is_exactly_the_documented_variables():
    assert [variable.name for variable in envs.VARIABLES] == list(EXPECTED_DEFAULTS)


@pytest.mark.parametrize("name, default", EXPECTED_DEFAULTS.items())
def test_unset_variable_parses_to_its_default(clean_environ, name, default):
    assert getattr(envs.reload(), name) == default


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("YES", True), ("On", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False),
])
def test_booleans_accept_the_usual_words_in_any_case(monkeypatch, raw, expected):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", raw)
    assert envs.reload().DEEPINFER_BATCH_INVARIANT is expected


def test_set_values_are_typed(monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    monkeypatch.setenv("DEEPINFER_LOGGING_LEVEL", "debug")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", "~/models/v4")
    monkeypatch.setenv("DEEPINFER_PLUGINS", "")
    parsed = envs.reload()
    assert parsed.DEEPINFER_USE_NEXTN_DECODE == 3
    assert parsed.DEEPINFER_LOGGING_LEVEL == "DEBUG"
    assert parsed.DEEPINFER_HF_MODEL_DIR == Path.home() / "models" / "v4"
    # Empty is a value ("load no plugins"), not the same as unset.
    assert parsed.DEEPINFER_PLUGINS == ""


BAD_VALUES = [
    ("DEEPINFER_USE_NEXTN_DECODE", "abc", "an integer >= 1"),
    ("DEEPINFER_USE_NEXTN_DECODE", "0", "an integer >= 1"),
    ("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "-140", "an integer >= 1"),
    ("DEEPINFER_BATCH_INVARIANT", "maybe", "one of 1, true, yes, on, 0, false, no, off"),
    ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "fast", "one of off, compact"),
    ("DEEPINFER_ACCELERATOR", "tpu", "one of auto, cpu, nvidia, ascend"),
    ("DEEPINFER_HF_MODEL_DIR", "", "a non-empty filesystem path"),
]


@pytest.mark.parametrize("name, raw, allowed", BAD_VALUES, ids=[f"{n}={r}" for n, r, _ in BAD_VALUES])
def test_bad_value_names_the_variable_the_value_and_what_is_allowed(monkeypatch, name, raw, allowed):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError) as error:
        envs.reload()
    message = str(error.value)
    assert f"{name}={raw!r}" in message
    assert allowed in message


def test_unknown_variable_is_warned_about_with_a_suggestion(monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_FOO", "1")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANTS", "1")
    envs.reload()
    assert "unknown environment variable DEEPINFER_FOO" in caplog.text
    assert "DEEPINFER_BATCH_INVARIANTS is ignored (did you mean DEEPINFER_BATCH_INVARIANT?)" in caplog.text


def test_environment_is_parsed_once(monkeypatch):
    first = envs.reload()
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert envs.get() is first
    assert envs.reload().DEEPINFER_USE_NEXTN_DECODE == 2


def test_parsed_environment_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        envs.get().DEEPINFER_USE_NEXTN_DECODE = 7


def test_markdown_table_lists_every_variable():
    lines = envs.markdown_table().splitlines()
    assert lines[0] == "| Variable | Type | Default | Meaning |"
    for variable in envs.VARIABLES:
        assert sum(f"`{variable.name}`" in line for line in lines) == 1, variable.name
    assert len(lines) == 2 + len(envs.VARIABLES)


def test_module_prints_the_markdown_table():
    printed = subprocess.run([sys.executable, "-m", "deepinfer.envs"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).parents[1]).stdout
    assert printed.strip() == envs.markdown_table()


def test_engine_features_take_their_defaults_from_the_variables(monkeypatch):
    """Each feature's variable fills its ``EngineConfig`` field's default when a config is built; an engine
    argument overrides it, and must be a value the variable could give."""
    from deepinfer.engine.config import EngineConfig

    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "0")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "HOST")
    envs.reload()
    config = EngineConfig()
    assert (config.async_scheduling, config.num_speculative_tokens, config.engram_tables) == (False, 3, "host")
    assert config.enable_mtp_varlen is None and not config.batch_invariant
    assert EngineConfig(async_scheduling=True, enable_mtp_varlen=False).async_scheduling
    with pytest.raises(ValueError, match=r"engram_tables \(DEEPINFER_ENGRAM_TABLES's value by default\) must be "
                                         "one of auto, device, host, got 'gpu'"):
        EngineConfig(engram_tables="gpu")
    with pytest.raises(ValueError, match="num_speculative_tokens .* must be an integer >= 1, got 0"):
        EngineConfig(num_speculative_tokens=0)
