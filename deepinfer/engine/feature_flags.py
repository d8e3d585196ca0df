"""Feature switches that only a separately installed plugin can serve.

Turning one on without its plugin is an error naming the distribution to install, so a
setting is never accepted and then silently ignored.
"""

from __future__ import annotations

import os

from deepinfer import envs
from deepinfer.engine.config import EngineConfig
from deepinfer.plugins.manager import pm

# config field -> (is it switched on?, plugin name the distribution registers, distribution, folder)
_FEATURES = {
    "enable_mtp_varlen": (lambda varlen: varlen is not None, "mtp", "deepinfer-mtp", "features/mtp"),
    "prefill_truncation_mode": (lambda mode: mode != "off", "swa_replay", "deepinfer-swa-replay",
                                "features/swa_replay"),
    "batch_invariant": (bool, "batch_invariant", "deepinfer-batch-invariant", "features/batch_invariant"),
}


def _setting(config: EngineConfig, name: str) -> str:
    """How the user asked for the feature: the variable as they set it, or the engine argument."""
    variable, value = EngineConfig.variable_of(name), getattr(config, name)
    if variable in os.environ and getattr(envs.get(), variable) == value:
        return f"{variable}={os.environ[variable]}"
    return f"{name}={value!r}"


def check_feature_plugins(config: EngineConfig) -> None:
    for name, (switched_on, plugin, distribution, folder) in _FEATURES.items():
        if switched_on(getattr(config, name)) and not pm.has_plugin(plugin):
            raise ValueError(
                f"{_setting(config, name)} needs the {distribution} plugin ({folder}), which is not installed "
                f"or was excluded by DEEPINFER_PLUGINS"
            )
