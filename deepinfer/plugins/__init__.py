"""DeepInfer's plugin system: the hook markers and the plugin manager."""

from deepinfer.plugins.hookspecs import hookimpl, hookspec

_MANAGER_NAMES = (
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "PluginError",
    "call_all",
    "check_pending",
    "list_plugins",
    "load_entry_point_plugins",
    "load_plugins",
    "pm",
    "registered",
    "select_backend",
    "select_optional_backend",
)

__all__ = ["hookimpl", "hookspec", *_MANAGER_NAMES]


def __getattr__(name: str):
    # Plugins import hookimpl from here; only the engine needs the manager, which parses the
    # DEEPINFER_* environment and sets up logging when it is imported.
    if name in _MANAGER_NAMES:
        from deepinfer.plugins import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'deepinfer.plugins' has no attribute {name!r}")
