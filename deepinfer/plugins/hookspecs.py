"""DeepInfer's hook specifications.

Every hook receives the engine configuration (``device`` is a ``torch.device``).
``deepinfer_configure_engine`` is called on every plugin. The others are ``firstresult``: the
first plugin that returns an object serves the hook and later plugins are not asked; a plugin
declines by returning ``None``. Attention, vision attention, MoE, linear, mHC and sampler must be served (the built-in
reference plugins always answer); drafter, prefill truncation and logits processor may go
unanswered, which means the feature is off. ``deepinfer_step_context``, like ``deepinfer_configure_engine``, asks
every plugin. Plugins are asked in pluggy's order (latest
registered first, so entry-point plugins before the built-ins; ``tryfirst``/``trylast``
adjust it). Hook wrappers are not supported.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("deepinfer")
hookimpl = pluggy.HookimplMarker("deepinfer")


@hookspec
def deepinfer_configure_engine(config):
    """Inspect (and where documented, adjust) the ``EngineConfig`` before anything is built.

    Called once per engine, by every plugin. Raise ``ValueError`` to refuse a
    combination of settings the plugin cannot honour.
    """


@hookspec(firstresult=True)
def deepinfer_attention_backend(config, device):
    """Return an ``AttentionBackend`` for ``device`` or ``None`` to decline.

    It serves sparse attention with sinks over paged KV rows and the indexer's top-k.
    """


@hookspec(firstresult=True)
def deepinfer_vision_attention_backend(config, device):
    """Return a ``VisionAttentionBackend`` (the vision tower's full attention over an image's patches) or ``None``."""


@hookspec(firstresult=True)
def deepinfer_moe_backend(config, device):
    """Return a ``MoEBackend`` (routed experts given top-k ids and weights) or ``None``."""


@hookspec(firstresult=True)
def deepinfer_linear_backend(config, device):
    """Return a ``LinearBackend`` multiplying by FP8 block-scaled and MXFP4 weights, or ``None``."""


@hookspec(firstresult=True)
def deepinfer_mhc_backend(config, device):
    """Return an ``MHCBackend`` (the hyper-connection weights, Sinkhorn included) or ``None``."""


@hookspec(firstresult=True)
def deepinfer_sampler(config, device):
    """Return a ``Sampler`` turning a batch of logits into tokens, or ``None``."""


@hookspec(firstresult=True)
def deepinfer_drafter(config, context):
    """Return a ``Drafter`` proposing speculative tokens for the model ``context`` (a ``DraftContext``: what a
    drafter may use of it) describes, or ``None`` (no speculation)."""


@hookspec(firstresult=True)
def deepinfer_prefill_truncation(config, model_config):
    """Return a ``PrefillTruncation`` policy for the model's decoder layers, or ``None`` (full prefill)."""


@hookspec(firstresult=True)
def deepinfer_logits_processor(config, tokenizer, vocab_size):
    """Return a ``LogitsProcessor`` for requests with ``so_args`` (structured outputs), or ``None``;
    ``vocab_size`` is the model's (its logits' width, which may exceed the tokenizer's)."""


@hookspec
def deepinfer_step_context(config, device):
    """Return a context manager the engine enters around every step (forward passes, CUDA-graph captures, drafts and
    sampling), or ``None``. Meant for torch-level op overrides such as a ``torch.overrides.TorchFunctionMode``;
    the engine enters every plugin's context, in call order."""


@hookspec(firstresult=True)
def deepinfer_token_exchange(config, ranks):
    """Return a ``TokenExchange`` moving expert parallelism's tokens between ``ranks`` (a
    ``deepinfer.parallel.ranks.Ranks``) or ``None``; asked only when ``enable_expert_parallel`` is on. The
    built-in one uses ``torch.distributed.all_to_all_single``."""
