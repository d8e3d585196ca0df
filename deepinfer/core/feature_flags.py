"""Feature switches that only a separately installed plugin can serve.

Turning one on without its plugin is an error naming the distribution to install, so a
setting is never accepted and then silently ignored.
"""

from __future__ import annotations

import os

from deepinfer import envs
from deepinfer.plugins.manager import pm

# variable -> (is it switched on?, plugin name the distribution registers, distribution, folder)
_FEATURES = {
    "DEEPINFER_ENABLE_MTP_VARLEN": (lambda varlen: varlen is not None, "mtp", "deepinfer-mtp", "features/mtp"),
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": (lambda mode: mode != "off", "swa_replay", "deepinfer-swa-replay", "features/swa_replay"),
    "DEEPINFER_BATCH_INVARIANT": (bool, "batch_invariant", "deepinfer-batch-invariant", "features/batch_invariant"),
}


def check_feature_plugins() -> None:
    env = envs.get()
    for variable, (switched_on, plugin, distribution, folder) in _FEATURES.items():
        value = getattr(env, variable)
        if switched_on(value) and not pm.has_plugin(plugin):
            raise ValueError(
                f"{variable}={os.environ.get(variable, value)} needs the {distribution} plugin ({folder}), which is not installed "
                f"or was excluded by DEEPINFER_PLUGINS"
            )
