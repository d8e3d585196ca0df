"""DeepInfer: offline inference for DeepSeek-V4-family models."""

from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.plugins.hookspecs import hookimpl
from deepinfer.sampling_params import SamplingParams
from deepinfer.version import __version__
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "hookimpl"]


def __getattr__(name: str):
    # The engine pulls in torch and transformers; keep `import deepinfer` cheap for plugins and tools.
    if name == "LLM":
        from deepinfer.llm import LLM

        return LLM
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
