"""Which torch device the engine runs on, checked before anything is allocated there: a device torch cannot use
fails here with one sentence naming it, not in the middle of building the caches."""

from __future__ import annotations

import importlib.util

import torch


class DeviceUnavailable(RuntimeError):
    """The requested device (or DEEPINFER_ACCELERATOR's) is not one this torch can use."""


def resolve_device(requested: str, accelerator: str) -> torch.device:
    """``requested`` ("auto", "cpu", "cuda[:N]", "npu[:N]") as a usable ``torch.device``; "auto" follows
    ``accelerator`` (DEEPINFER_ACCELERATOR: "nvidia" must find a GPU, "auto" takes one if present)."""
    if requested == "auto":
        if accelerator in ("nvidia", "auto") and torch.cuda.is_available():
            return torch.device("cuda")
        if accelerator == "nvidia":
            raise DeviceUnavailable(f"DEEPINFER_ACCELERATOR=nvidia, but {_why_no_cuda()}")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise ValueError(f"device {requested!r} is not a device torch knows (auto, cpu, cuda, cuda:N, npu, "
                         f"npu:N)") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {requested!r}: {_why_no_cuda()}")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceUnavailable(f"device {requested!r}: torch sees {count} CUDA device(s) (cuda:0 to "
                                    f"cuda:{count - 1})")
    elif device.type == "npu" and importlib.util.find_spec("torch_npu") is None:
        raise DeviceUnavailable(f"device {requested!r}: torch_npu is not installed (DEEPINFER_ACCELERATOR=ascend "
                                "./build.sh installs it)")
    return device


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a build without CUDA; install a CUDA build of torch "
                "(https://pytorch.org/get-started/locally/)")
    return f"torch (CUDA {torch.version.cuda}) sees no CUDA device"
