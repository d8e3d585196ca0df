import importlib
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import deepinfer
from deepinfer import SamplingParams, envs
from deepinfer.engine.config import EngineConfig
from deepinfer.plugins import (PluginError, call_all, check_pending, hookimpl, list_plugins,
                               load_entry_point_plugins, load_plugins, manager, pm, registered,
                               select_backend, select_optional_backend)
from deepinfer.llm import LLM
from deepinfer.plugins.builtin.torch_attention import TorchAttention
from deepinfer.plugins.interfaces import SamplerOutput, SamplingBatch
from deepinfer.plugins.manager import checked

TESTS_DIR = Path(__file__).parent
EXAMPLE_PLUGIN_DIR = TESTS_DIR / "example_plugin"
CPU = torch.device("cpu")


@dataclass(slots=True)
class NamedBackend:
    name: str


def attention_plugin(backend_name: str | None, **order) -> object:
    """A throwaway plugin serving attention with a backend of that name (``None`` declines)."""

    class AnswersAttention:
        # Takes only ``device`` of the spec's (config, device): pluggy's subset-argument rule.
        @hookimpl(**order)
        def deepinfer_attention_backend(self, device):
            return NamedBackend(backend_name) if backend_name else None

    return AnswersAttention()


def select_attention() -> tuple[object, str]:
    return select_backend("deepinfer_attention_backend", config=None, device=CPU)


# A plugin module as a third party would write it; its backend is named after the module.
ATTENTION_MODULE = """
from types import SimpleNamespace
from deepinfer.plugins import hookimpl

@hookimpl
def deepinfer_attention_backend(config, device):
    return SimpleNamespace(name=__name__)
"""


def set_plugins_variable(monkeypatch, value: str | None) -> None:
    monkeypatch.delenv("DEEPINFER_PLUGINS", raising=False)
    if value is not None:
        monkeypatch.setenv("DEEPINFER_PLUGINS", value)
    envs.reload()


@pytest.mark.parametrize("first_order, second_order, winner", [
    ({"tryfirst": True}, {}, "first"),
    ({}, {"trylast": True}, "first"),
    ({}, {}, "second"),
])
def test_latest_registration_is_asked_first_unless_tryfirst_or_trylast(first_order, second_order, winner):
    with registered(attention_plugin("first", **first_order), "first"), \
            registered(attention_plugin("second", **second_order), "second"):
        backend, plugin = select_attention()
    assert (backend.name, plugin) == (winner, winner)


def test_plugin_returning_none_declines():
    with registered(attention_plugin("fallback"), "fallback"), registered(attention_plugin(None), "declines"):
        assert select_attention()[1] == "fallback"


def test_when_every_plugin_declines_only_the_optional_selection_accepts_it():
    with pytest.raises(PluginError, match="no installed plugin serves deepinfer_drafter"):
        select_backend("deepinfer_drafter", config=None, context=None)
    assert select_optional_backend("deepinfer_drafter", config=None, context=None) is None


def test_selection_is_logged_once_naming_backend_and_plugin(caplog):
    with registered(attention_plugin("logged-once"), "logging-plugin"):
        select_attention()
        select_attention()
    line = "attention backend: logged-once (plugin logging-plugin)"
    assert caplog.text.count(line) == 1


def test_raising_plugin_is_named_and_its_error_chained():
    original = RuntimeError("kernel library missing")

    class Explodes:
        @hookimpl
        def deepinfer_attention_backend(self, config, device):
            raise original

    with registered(attention_plugin("never-asked"), "fine"), registered(Explodes(), "exploding"):
        with pytest.raises(PluginError) as error:
            select_attention()
    assert "plugin 'exploding' failed in deepinfer_attention_backend" in str(error.value)
    assert error.value.__cause__ is original


def test_misspelled_hook_fails_check_pending_with_a_suggestion():
    class Misspelled:
        @hookimpl
        def deepinfer_atention_backend(self, config, device):
            return None

    with registered(Misspelled(), "misspelled"):
        with pytest.raises(PluginError) as error:
            check_pending()
    assert str(error.value) == ("plugin 'misspelled' implements 'deepinfer_atention_backend', which is "
                                "not a deepinfer hook; did you mean 'deepinfer_attention_backend'?")


def test_hooks_must_be_called_with_their_spec_arguments_and_kind():
    with pytest.raises(TypeError, match="takes config, device; got device"):
        select_backend("deepinfer_attention_backend", device=CPU)
    with pytest.raises(TypeError, match="asks every plugin; use call_all"):
        select_backend("deepinfer_configure_engine", config=None)
    with pytest.raises(TypeError, match="is served by one plugin; use select_backend"):
        call_all("deepinfer_sampler", config=None, device=CPU)
    with pytest.raises(PluginError, match="'deepinfer_atention_backend' is not a deepinfer hook"):
        select_backend("deepinfer_atention_backend", config=None, device=CPU)


def test_trace_logs_each_hook_call_and_answer(monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_TRACE_PLUGINS", "1")
    envs.reload()
    with registered(attention_plugin("traced"), "tracing-plugin"):
        select_attention()
    assert "deepinfer_attention_backend(config=None, device=device(type='cpu')) asks tracing-plugin" in caplog.text
    assert "plugin tracing-plugin -> NamedBackend(name='traced')" in caplog.text


def test_registered_unregisters_even_when_the_block_fails():
    with pytest.raises(KeyError), registered(attention_plugin("temporary"), "temporary"):
        raise KeyError("boom")
    assert not pm.has_plugin("temporary")


class BatchLimit:
    """A throwaway plugin that records the configs it sees and refuses batches above a limit."""

    def __init__(self, limit: int):
        self.limit, self.seen = limit, []

    @hookimpl
    def deepinfer_configure_engine(self, config):
        self.seen.append(config)
        if config.max_num_seqs > self.limit:
            raise ValueError(f"max_num_seqs above {self.limit} is not supported")


def test_hook_deepinfer_configure_engine():
    small, large = SimpleNamespace(max_num_seqs=8), SimpleNamespace(max_num_seqs=128)
    strict, lenient = BatchLimit(64), BatchLimit(1024)
    with registered(strict, "strict"), registered(lenient, "lenient"):
        assert call_all("deepinfer_configure_engine", config=small) == []
        with pytest.raises(PluginError, match="plugin 'strict' failed in deepinfer_configure_engine") as error:
            call_all("deepinfer_configure_engine", config=large)
    assert strict.seen == [small, large] and lenient.seen == [small, large]
    assert isinstance(error.value.__cause__, ValueError)


@pytest.mark.parametrize("selection, expected", [(None, {"fake", "other"}), ("", set()), ("other", {"other"})])
def test_plugins_variable_selects_entry_points(install, monkeypatch, selection, expected):
    install("fake_plugin", {"fake": "fake_plugin"}, ATTENTION_MODULE)
    install("other_plugin", {"other": "other_plugin"}, ATTENTION_MODULE)
    set_plugins_variable(monkeypatch, selection)
    loaded = set(load_entry_point_plugins())
    # Unset loads everything installed, which may include real plugins of this environment.
    assert loaded >= expected if selection is None else loaded == expected


def test_plugins_variable_warns_about_names_nothing_provides(install, monkeypatch, caplog):
    install("fake_plugin", {"fake": "fake_plugin"}, ATTENTION_MODULE)
    set_plugins_variable(monkeypatch, "fake, nope")
    assert load_entry_point_plugins() == ["fake"]
    assert "DEEPINFER_PLUGINS names nope, which no installed plugin provides; installed:" in caplog.text
    assert "fake" in caplog.text.split("installed:")[1]


def test_entry_point_that_fails_to_import_is_named(install, monkeypatch):
    install("broken_plugin", {"broken": "broken_plugin"}, "import not_a_module_anywhere\n")
    set_plugins_variable(monkeypatch, "broken")
    with pytest.raises(PluginError, match="plugin 'broken' .* failed to load") as error:
        load_entry_point_plugins()
    assert isinstance(error.value.__cause__, ImportError)


@pytest.mark.parametrize("under_test, serving_plugin", [(False, "fake"), (True, "builtin_stand_in")])
def test_load_plugins_registers_builtins_then_entry_points_unless_under_test(
        install, monkeypatch, under_test, serving_plugin):
    install("builtin_stand_in", {}, ATTENTION_MODULE)
    install("fake_plugin", {"fake": "fake_plugin"}, ATTENTION_MODULE)
    set_plugins_variable(monkeypatch, None)
    monkeypatch.setattr(manager, "DEFAULT_PLUGINS", ("builtin_stand_in",))
    monkeypatch.setattr(manager, "_loaded", False)
    if not under_test:
        monkeypatch.delattr(sys, "_called_from_test")  # load as a real process would
    load_plugins()
    assert pm.has_plugin("builtin_stand_in")
    # The built-in came first, so an entry point that is loaded is asked before it.
    assert select_attention()[1] == serving_plugin


def test_missing_builtin_module_is_a_clear_import_error(monkeypatch):
    monkeypatch.setattr(manager, "DEFAULT_PLUGINS", ("deepinfer.plugins.builtin.not_written_yet",))
    monkeypatch.setattr(manager, "_loaded", False)
    with pytest.raises(ImportError, match="built-in plugin deepinfer.plugins.builtin.not_written_yet"):
        load_plugins()


def test_list_plugins_reports_versions_and_hooks(install, monkeypatch):
    install("fake_plugin", {"fake": "fake_plugin"}, ATTENTION_MODULE)
    set_plugins_variable(monkeypatch, "fake")
    load_entry_point_plugins()
    with registered(attention_plugin("in-process"), "in-process"):
        rows = {row["name"]: row for row in list_plugins()}
    assert rows["fake"] == {"name": "fake", "version": "0.1", "hooks": ["deepinfer_attention_backend"]}
    assert rows["in-process"]["version"] == deepinfer.__version__


@pytest.fixture
def builtins_loaded(monkeypatch):
    """The real built-in plugins, loaded as the engine loads them (no entry points under test)."""
    monkeypatch.setattr(manager, "_loaded", False)
    load_plugins()


def greedy_batch(rows: int, num_logprobs: int) -> SamplingBatch:
    zeros, ones = torch.zeros(rows), torch.ones(rows)
    empty = [[] for _ in range(rows)]
    return SamplingBatch(
        temperature=zeros, top_k=zeros.long(), top_p=ones, min_p=zeros, presence_penalty=zeros,
        frequency_penalty=zeros, repetition_penalty=ones, seeds=-torch.ones(rows, dtype=torch.long),
        positions=zeros.long(), prompt_token_ids=empty, output_token_ids=empty, blocked_token_ids=empty,
        num_logprobs=num_logprobs, all_greedy=True, any_penalties=False)


def select_sampler() -> tuple[object, str]:
    return select_backend("deepinfer_sampler", config=None, device=CPU)


def test_example_plugin_module_replaces_the_builtin_sampler(builtins_loaded, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE_PLUGIN_DIR)
    example = importlib.import_module("deepinfer_example_plugin")
    assert select_sampler()[1] == "deepinfer.plugins.builtin.torch_sampler"
    with registered(example, "example"):
        sampler, plugin = select_sampler()
    assert (sampler.name, plugin) == ("example-greedy", "example")
    calls_before = sampler.calls
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 1.0]])
    output = sampler.sample(logits, greedy_batch(rows=2, num_logprobs=2))
    assert isinstance(output, SamplerOutput)
    assert output.token_ids.tolist() == [1, 0]
    assert torch.allclose(output.logprobs, torch.log_softmax(logits, -1).max(-1).values)
    assert sampler.calls == calls_before + 1


def test_example_plugin_installed_through_its_entry_point(builtins_loaded, install, monkeypatch):
    project = tomllib.loads((EXAMPLE_PLUGIN_DIR / "pyproject.toml").read_text())["project"]
    install(project["name"].replace("-", "_"), project["entry-points"]["deepinfer.plugins"])
    monkeypatch.syspath_prepend(EXAMPLE_PLUGIN_DIR)
    set_plugins_variable(monkeypatch, "example")
    assert load_entry_point_plugins() == ["example"]
    sampler, plugin = select_sampler()
    assert (sampler.name, plugin) == ("example-greedy", "example")


EXAMPLE_ATTENTION_DIR = TESTS_DIR / "example_attention_plugin"


def test_example_attention_plugin_serves_the_engine_with_the_references_outputs(builtins_loaded, monkeypatch):
    """The worked attention backend: selected and checked against the protocol, it serves a whole generation (its
    RMSNorm runs), and the greedy tokens are the built-in reference's."""
    monkeypatch.syspath_prepend(EXAMPLE_ATTENTION_DIR)
    example = importlib.import_module("deepinfer_example_attention")
    prompts, params = ["def add(a, b):", "import os"], SamplingParams(temperature=0, max_tokens=6)
    expected = [o.outputs[0].token_ids for o in LLM("deepinfer-tiny-v4.1").generate(prompts, params, use_tqdm=False)]
    with registered(example, "example_attention"):
        backend, plugin = checked("deepinfer_attention_backend",
                                  select_backend("deepinfer_attention_backend", config=EngineConfig(), device=CPU))
        assert (backend.name, plugin) == ("example-fused-norm", "example_attention")
        llm = LLM("deepinfer-tiny-v4.1")
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.engine.attention.name == "example-fused-norm" and llm.engine.attention.norm_calls > 0


HOOK_NAMES = sorted(name for name, caller in vars(pm.hook).items() if caller.has_spec())
HOOK_TESTS = {name for path in TESTS_DIR.rglob("test_*.py")
              for name in re.findall(r"def (test_hook_\w+)\(", path.read_text())}


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hook_has_a_test(hook_name):
    assert f"test_hook_{hook_name}" in HOOK_TESTS, f"no test named test_hook_{hook_name} under tests/"


def test_entry_points_are_asked_by_declared_priority_not_by_name_or_selection(install, monkeypatch):
    """A device plugin declares a higher DEEPINFER_PRIORITY than a feature plugin, so it is asked first even when
    its name sorts first or DEEPINFER_PLUGINS lists it first."""
    install("a_device", {"a_device": "a_device"}, ATTENTION_MODULE + "DEEPINFER_PRIORITY = 10\n")
    install("z_feature", {"z_feature": "z_feature"}, ATTENTION_MODULE)
    for selection in ("a_device,z_feature", "z_feature,a_device"):
        set_plugins_variable(monkeypatch, selection)
        assert load_entry_point_plugins() == ["z_feature", "a_device"]  # the latest registration is asked first
        assert select_attention()[1] == "a_device"
        for name in ("a_device", "z_feature"):
            pm.unregister(name=name)


def test_a_priority_that_is_not_an_int_is_an_error(install, monkeypatch):
    install("odd", {"odd": "odd"}, ATTENTION_MODULE + "DEEPINFER_PRIORITY = 'high'\n")
    set_plugins_variable(monkeypatch, "odd")
    with pytest.raises(PluginError, match="plugin 'odd': DEEPINFER_PRIORITY must be an int, got 'high'"):
        load_entry_point_plugins()


def test_device_plugins_outrank_feature_plugins(monkeypatch):
    for backend in ("nvidia", "ascend"):  # importable without their accelerators; not pip-installed on a CPU host
        monkeypatch.syspath_prepend(str(TESTS_DIR.parent / "backends" / backend))
    import deepinfer_ascend.plugin
    import deepinfer_batch_invariant.plugin
    import deepinfer_nvidia.plugin

    feature = getattr(deepinfer_batch_invariant.plugin, manager.PRIORITY_ATTRIBUTE, 0)
    assert deepinfer_nvidia.plugin.DEEPINFER_PRIORITY > feature < deepinfer_ascend.plugin.DEEPINFER_PRIORITY


def test_a_backend_without_a_method_of_its_protocol_is_refused_when_the_engine_selects_it(tiny_v4_checkpoint):
    class HalfAttention:
        @hookimpl
        def deepinfer_attention_backend(self, device):
            return SimpleNamespace(name="half", graph_safe=True, sparse_attention=lambda *args: None)

    with registered(HalfAttention(), "half"), pytest.raises(
            PluginError, match="plugin 'half' serves deepinfer_attention_backend with a SimpleNamespace that lacks "
                               "compress_pool, store_compressor_rows, rotate, .*, indexer_scores of AttentionBackend"):
        LLM(str(tiny_v4_checkpoint), dtype="float32")
    reference = TorchAttention()
    assert checked("deepinfer_attention_backend", (reference, "builtin")) == (reference, "builtin")
