"""Where the checkpoint comes from: DEEPINFER_HF_MODEL_DIR, a local directory, or the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

from deepinfer import envs

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
# Only what DeepInfer reads: config, tokenizer and index JSON, the weights, and a SentencePiece model if one ships.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model"]


def resolve_model_dir(model: str | None = None) -> Path:
    """The local directory holding the checkpoint, downloading it from the Hub if needed.

    DEEPINFER_HF_MODEL_DIR wins over ``model``; ``model`` may be a local directory or a Hub repo id and defaults to
    DEFAULT_MODEL. HF_HUB_OFFLINE, HF_HOME and HF_TOKEN are honoured by huggingface_hub itself.
    """
    override = envs.get().DEEPINFER_HF_MODEL_DIR
    if override is not None:
        if not override.is_dir():
            raise FileNotFoundError(f"DEEPINFER_HF_MODEL_DIR={str(override)!r} is not a directory")
        return override
    model = model or DEFAULT_MODEL
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if _looks_like_path(model):
        raise FileNotFoundError(f"Model directory {model!r} does not exist")
    return _download(model)


def _looks_like_path(model: str) -> bool:
    # A repo id is "name" or "owner/name"; anything else can only have meant a directory.
    return model.startswith(("/", ".", "~")) or model.count("/") > 1


def _download(repo_id: str) -> Path:
    # Imported lazily: a local checkpoint needs no Hub client.
    from huggingface_hub import constants, is_offline_mode, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    use_local = "Set DEEPINFER_HF_MODEL_DIR=/path/to/model to use a local checkpoint directory instead."
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except LocalEntryNotFoundError as err:
        reason = "HF_HUB_OFFLINE is set" if is_offline_mode() else "the Hugging Face Hub could not be reached"
        raise FileNotFoundError(
            f"Model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be "
            f"downloaded because {reason}. {use_local}"
        ) from err
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(
            f"Hugging Face repository {repo_id!r} does not exist or needs access you do not have "
            f"(log in with HF_TOKEN if it is gated). {use_local}"
        ) from err
