"""Where the checkpoint comes from: DEEPINFER_HF_MODEL_DIR, a local directory, the Hugging Face Hub, or the small
trained model shipped inside the package."""

from __future__ import annotations

import logging
from pathlib import Path

from deepinfer import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
# A 12 M-parameter DeepSeek-V4.1-architecture model trained on Python's standard library (tools/training/train_tiny_v41.py),
# in the release's checkpoint format: what runs when the default model cannot be fetched.
EMBEDDED_MODEL = "deepinfer-tiny-v4.1"
EMBEDDED_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_v41"
# Only what DeepInfer reads: config, tokenizer and index JSON, the weights, and a SentencePiece model if one ships.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model"]


def resolve_model_dir(model: str | None = None) -> Path:
    """The local directory holding the checkpoint, downloading it from the Hub if needed.

    DEEPINFER_HF_MODEL_DIR wins over ``model``; ``model`` may be a local directory, a Hub repo id or
    EMBEDDED_MODEL. ``None`` means DEFAULT_MODEL, and when that cannot be fetched (offline, or the Hub refuses it)
    the embedded model, with one warning. HF_HUB_OFFLINE, HF_HOME and HF_TOKEN are honoured by huggingface_hub.
    """
    override = envs.get().DEEPINFER_HF_MODEL_DIR
    if override is not None:
        if not override.is_dir():
            raise FileNotFoundError(f"DEEPINFER_HF_MODEL_DIR={str(override)!r} is not a directory")
        return override
    if model == EMBEDDED_MODEL:
        return EMBEDDED_MODEL_DIR
    if model is None:
        try:
            return _download(DEFAULT_MODEL)
        except HubUnavailable as err:
            logger.warning("%s cannot be fetched (%s); using the embedded %r instead, a tiny model trained on Python's "
                           "standard library for trying DeepInfer out. For real weights set "
                           "DEEPINFER_HF_MODEL_DIR=/path/to/model or pass model=...", DEFAULT_MODEL, err.reason,
                           EMBEDDED_MODEL)
            return EMBEDDED_MODEL_DIR
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if _looks_like_path(model):
        raise FileNotFoundError(f"Model directory {model!r} does not exist")
    return _download(model)


def _looks_like_path(model: str) -> bool:
    # A repo id is "name" or "owner/name"; anything else can only have meant a directory.
    return model.startswith(("/", ".", "~")) or model.count("/") > 1


class HubUnavailable(FileNotFoundError):
    """The Hub cannot provide the model: offline, unreachable, no such repository, or gated."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _download(repo_id: str) -> Path:
    # Imported lazily: a local checkpoint needs no Hub client.
    from huggingface_hub import constants, is_offline_mode, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    use_local = "Set DEEPINFER_HF_MODEL_DIR=/path/to/model to use a local checkpoint directory instead."
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except LocalEntryNotFoundError as err:
        reason = "HF_HUB_OFFLINE is set" if is_offline_mode() else "the Hugging Face Hub could not be reached"
        raise HubUnavailable(
            f"Model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be "
            f"downloaded because {reason}. {use_local}", reason
        ) from err
    except RepositoryNotFoundError as err:
        raise HubUnavailable(
            f"Hugging Face repository {repo_id!r} does not exist or needs access you do not have "
            f"(log in with HF_TOKEN if it is gated). {use_local}", "no such repository, or it is gated"
        ) from err
