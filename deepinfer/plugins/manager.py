"""The plugin manager: loads built-in and installed plugins once, then asks them one by one.

Hooks are called through ``select_backend`` / ``call_all`` rather than ``pm.hook.<name>(...)``
because calling each implementation ourselves is what lets us say which plugin answered and
which plugin failed.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.metadata
import logging
import sys
import types
from collections.abc import Iterator

import pluggy

from deepinfer import envs
from deepinfer.logger import init_logger, log_once
from deepinfer.plugins import hookspecs, interfaces
from deepinfer.version import __version__

ENTRY_POINT_GROUP = "deepinfer.plugins"
# A plugin module's asking priority (an int, default 0): entry points register in ascending priority, then by name,
# and pluggy asks the latest registration first, so a higher priority is asked first whatever the names and
# DEEPINFER_PLUGINS say. Device plugins declare more than feature plugins: they serve the modes they support with
# their own kernels, and decline the rest.
PRIORITY_ATTRIBUTE = "DEEPINFER_PRIORITY"

# Registered before any entry point, so installed plugins are asked first (pluggy asks the
# latest registration first) and the built-ins answer only what nobody else does.
DEFAULT_PLUGINS = (
    "deepinfer.plugins.builtin.torch_attention",
    "deepinfer.plugins.builtin.torch_vision_attention",
    "deepinfer.plugins.builtin.torch_moe",
    "deepinfer.plugins.builtin.torch_linear",
    "deepinfer.plugins.builtin.torch_mhc",
    "deepinfer.plugins.builtin.torch_sampler",
    "deepinfer.plugins.builtin.torch_exchange",
)

logger = init_logger(__name__)
_trace_logger = init_logger(__name__ + ".trace")
# Trace lines are written only when DEEPINFER_TRACE_PLUGINS asks for them, so asking must be
# enough to see them, whatever DEEPINFER_LOGGING_LEVEL says.
_trace_logger.setLevel(logging.DEBUG)

pm = pluggy.PluginManager("deepinfer")
# At import rather than in load_plugins: plugins registered without load_plugins (tests,
# notebooks) must still see firstresult semantics and argument validation.
pm.add_hookspecs(hookspecs)

_loaded = False


class PluginError(RuntimeError):
    """A plugin failed, named a hook that does not exist, or no plugin could serve a hook."""


def load_plugins() -> None:
    """Register the built-in plugins and the selected entry points; later calls do nothing."""
    global _loaded
    if _loaded:
        return
    for module_name in DEFAULT_PLUGINS:
        _register_builtin(module_name)
    # Under pytest, whatever happens to be installed must not change results; tests that
    # want entry points call load_entry_point_plugins() themselves.
    if not getattr(sys, "_called_from_test", False):
        load_entry_point_plugins()
    check_pending()
    _loaded = True
    logger.debug("plugins: %s", ", ".join(name for name, _ in pm.list_name_plugin()))


def _register_builtin(module_name: str) -> None:
    if pm.has_plugin(module_name):
        return
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"built-in plugin {module_name} could not be imported: {exc}",
                          name=module_name) from exc
    pm.register(module, name=module_name)


def load_entry_point_plugins() -> list[str]:
    """Register the installed ``deepinfer.plugins`` entry points that DEEPINFER_PLUGINS selects.

    Unset selects all, the empty string none, a comma list the entry points of those names.
    Returns the names registered by this call.
    """
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    available = sorted(entry_points.names)
    selected = {name: _priority(entry_points[name]) for name in _selected_entry_points(available)}
    loaded = []
    for name in sorted(selected, key=lambda name: (selected[name], name)):
        try:
            count = pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
        except Exception as exc:
            raise PluginError(f"plugin {name!r} (group {ENTRY_POINT_GROUP}) failed to load: {exc}") from exc
        if count:
            loaded.append(name)
    return loaded


def _priority(entry_point: importlib.metadata.EntryPoint) -> int:
    try:
        module = entry_point.load()
    except Exception as exc:
        raise PluginError(f"plugin {entry_point.name!r} (group {ENTRY_POINT_GROUP}) failed to load: {exc}") from exc
    priority = getattr(module, PRIORITY_ATTRIBUTE, 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise PluginError(f"plugin {entry_point.name!r}: {PRIORITY_ATTRIBUTE} must be an int, got {priority!r}")
    return priority


def _selected_entry_points(available: list[str]) -> list[str]:
    selection = envs.get().DEEPINFER_PLUGINS
    if selection is None:
        return available
    wanted = [name.strip() for name in selection.split(",") if name.strip()]
    missing = [name for name in wanted if name not in available]
    if missing:
        # A stale or misspelled name would otherwise silently run without the plugin.
        logger.warning("DEEPINFER_PLUGINS names %s, which no installed plugin provides; installed: %s",
                       ", ".join(missing), ", ".join(available) or "none")
    return [name for name in wanted if name in available]


def registered_modules() -> list[tuple[str, str]]:
    """(name, module) of every registered plugin in registration order: what a spawned rank registers so that it
    runs this process's plugins, not whatever its own start-up would pick."""
    rows = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        if not isinstance(plugin, types.ModuleType):
            raise PluginError(f"plugin {name!r} is registered as a {type(plugin).__name__} object, which a spawned "
                              "rank cannot import: register a module, or start the ranks with torchrun")
        rows.append((name, plugin.__name__))
    return rows


def register_modules(rows: list[tuple[str, str]]) -> None:
    """A spawned rank: register the plugins ``registered_modules`` listed in the process that spawned it."""
    global _loaded
    for name, module_name in rows:
        if not pm.has_plugin(name):
            pm.register(importlib.import_module(module_name), name=name)
    check_pending()
    _loaded = True


def check_pending() -> None:
    """Fail on an implementation of a hook that no spec declares: almost always a typo."""
    callers = {name: caller for name, caller in vars(pm.hook).items() if not name.startswith("_")}
    declared = [name for name, caller in callers.items() if caller.has_spec()]
    for name, caller in callers.items():
        if caller.has_spec():
            continue
        for impl in caller.get_hookimpls():
            if impl.optionalhook:
                continue
            close = difflib.get_close_matches(name, declared, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PluginError(f"plugin {impl.plugin_name!r} implements {name!r}, "
                              f"which is not a deepinfer hook{hint}")


# What each backend hook's answer implements: checked when the engine selects it (``checked``)
HOOK_PROTOCOLS = {
    "deepinfer_attention_backend": interfaces.AttentionBackend,
    "deepinfer_vision_attention_backend": interfaces.VisionAttentionBackend,
    "deepinfer_moe_backend": interfaces.MoEBackend,
    "deepinfer_linear_backend": interfaces.LinearBackend,
    "deepinfer_mhc_backend": interfaces.MHCBackend,
    "deepinfer_sampler": interfaces.Sampler,
    "deepinfer_drafter": interfaces.Drafter,
    "deepinfer_prefill_truncation": interfaces.PrefillTruncation,
    "deepinfer_logits_processor": interfaces.LogitsProcessor,
    "deepinfer_token_exchange": interfaces.TokenExchange,
}


def protocol_members(protocol: type) -> list[str]:
    """The attributes and methods a protocol asks for, in declaration order."""
    attributes = list(vars(protocol).get("__annotations__", {}))
    return attributes + [name for name, value in vars(protocol).items()
                         if callable(value) and not name.startswith("_") and name not in attributes]


def checked(hook_name: str, selection: tuple[object, str] | None) -> tuple[object, str] | None:
    """``selection`` (a backend and its plugin, or None) once the backend is found to have every member of its
    hook's protocol (``HOOK_PROTOCOLS``): a missing method fails here, naming plugin, hook and
    method, not deep inside a forward pass."""
    if selection is None:
        return None
    backend, plugin = selection
    protocol = HOOK_PROTOCOLS[hook_name]
    missing = [name for name in protocol_members(protocol) if not hasattr(backend, name)
               or (callable(getattr(protocol, name, None)) and not callable(getattr(backend, name)))]
    if missing:
        raise PluginError(f"plugin {plugin!r} serves {hook_name} with a {type(backend).__name__} that lacks "
                          f"{', '.join(missing)} of {protocol.__name__} (deepinfer/plugins/interfaces.py)")
    return selection


def select_backend(hook_name: str, **kwargs) -> tuple[object, str]:
    """Ask a firstresult hook's plugins in call order; return the first answer and its plugin.

    Raises ``PluginError`` when no plugin answers; use ``select_optional_backend`` for hooks
    where no answer is meaningful (no drafter, full prefill).
    """
    selection = select_optional_backend(hook_name, **kwargs)
    if selection is None:
        plugins = ", ".join(name for name, _ in pm.list_name_plugin()) or "none"
        raise PluginError(f"no installed plugin serves {hook_name} (plugins registered: {plugins})")
    return selection


def select_optional_backend(hook_name: str, **kwargs) -> tuple[object, str] | None:
    """Like ``select_backend``, but ``None`` when every plugin declines."""
    caller = _checked_caller(hook_name, kwargs, firstresult=True)
    for impl in _call_order(caller, kwargs):
        backend = _call(hook_name, impl, kwargs)
        if backend is not None:
            what = hook_name.removeprefix("deepinfer_").replace("_", " ")
            name = getattr(backend, "name", type(backend).__name__)
            log_once(logger, logging.INFO, f"{what}: {name} (plugin {impl.plugin_name})")
            return backend, impl.plugin_name
    return None


def call_all(hook_name: str, **kwargs) -> list[object]:
    """Call every plugin's implementation of a non-firstresult hook; return the non-None results."""
    caller = _checked_caller(hook_name, kwargs, firstresult=False)
    results = [_call(hook_name, impl, kwargs) for impl in _call_order(caller, kwargs)]
    return [result for result in results if result is not None]


def _checked_caller(hook_name: str, kwargs: dict, *, firstresult: bool) -> pluggy.HookCaller:
    caller = getattr(pm.hook, hook_name, None)
    if caller is None or not caller.has_spec():
        raise PluginError(f"{hook_name!r} is not a deepinfer hook")
    if caller.spec.opts.get("firstresult", False) != firstresult:
        advice = "asks every plugin; use call_all" if firstresult else "is served by one plugin; use select_backend"
        raise TypeError(f"{hook_name} {advice}")
    if set(kwargs) != set(caller.spec.argnames):
        raise TypeError(f"{hook_name} takes {', '.join(caller.spec.argnames)}; "
                        f"got {', '.join(sorted(kwargs)) or 'no arguments'}")
    return caller


def _call_order(caller: pluggy.HookCaller, kwargs: dict) -> list[pluggy.HookImpl]:
    impls = list(reversed(caller.get_hookimpls()))
    for impl in impls:
        if impl.wrapper or impl.hookwrapper:
            raise PluginError(f"plugin {impl.plugin_name!r} wraps {caller.name}, but deepinfer asks "
                              "plugins one at a time and cannot run wrappers")
    if envs.get().DEEPINFER_TRACE_PLUGINS:
        arguments = ", ".join(f"{name}={value!r}" for name, value in kwargs.items())
        _trace_logger.debug("%s(%s) asks %s", caller.name, arguments,
                            ", ".join(impl.plugin_name for impl in impls) or "no plugin")
    return impls


def _call(hook_name: str, impl: pluggy.HookImpl, kwargs: dict) -> object:
    # A plugin takes any subset of the spec's arguments (pluggy's rule), so specs can grow.
    arguments = {name: kwargs[name] for name in impl.argnames}
    try:
        result = impl.function(**arguments)
    except Exception as exc:
        raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook_name}: {exc!r}") from exc
    if envs.get().DEEPINFER_TRACE_PLUGINS:
        _trace_logger.debug("%s: plugin %s -> %r", hook_name, impl.plugin_name, result)
    return result


def list_plugins() -> list[dict[str, object]]:
    """Name, version and implemented hooks of every registered plugin (for ``deepinfer plugins``)."""
    distributions = pm.list_plugin_distinfo()
    rows = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked, not registered
            continue
        dist = next((dist for registered_plugin, dist in distributions if registered_plugin is plugin), None)
        rows.append({
            "name": name,
            "version": dist.version if dist is not None else __version__,
            "hooks": sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()),
        })
    return rows


@contextlib.contextmanager
def registered(plugin: object, name: str) -> Iterator[object]:
    """Register ``plugin`` under ``name`` for the duration of a ``with`` block."""
    pm.register(plugin, name=name)
    try:
        yield plugin
    finally:
        pm.unregister(name=name)
