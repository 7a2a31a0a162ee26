"""A hub name (``org/model``) -> a local folder, through huggingface_hub when it is installed and reachable.

Only the files a checkpoint folder needs are fetched: config / params / generation / tokenizer files and ONE set of
weights (safetensors when the repository has them; Mistral's consolidated file only for ``format="mistral"``).
"""

from __future__ import annotations

from pathlib import Path


class HubError(ValueError):
    """A hub name that could not be fetched; the message says why (no huggingface_hub, no network, no repo)."""


_SMALL = ("*.json", "tokenizer.model", "tokenizer.model.v3", "*.txt", "*.jinja")


def looks_like_hub_name(path: str) -> bool:
    parts = str(path).split("/")
    return len(parts) == 2 and all(parts) and not str(path).startswith((".", "~")) and not Path(path).exists()


def _weights_patterns(files: list[str], fmt: str | None) -> list[str]:
    if fmt == "mistral":
        return ["consolidated.safetensors"]
    if any(f.startswith("model") and f.endswith(".safetensors") for f in files):
        return ["model*.safetensors"]
    return ["pytorch_model*.bin"]


def download(repo_id: str, revision: str | None = None, format: str | None = None) -> Path:
    """The local snapshot folder of hub repository ``repo_id`` (cached by huggingface_hub)."""
    try:
        import huggingface_hub
    except ImportError:
        raise HubError(f"{repo_id!r} is not a local folder; to load it from the Hugging Face hub install "
                       f"huggingface_hub (pip install huggingface_hub), or download it and pass the folder") from None
    try:
        files = huggingface_hub.list_repo_files(repo_id, revision=revision)
        patterns = list(_SMALL) + _weights_patterns(files, format)
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repository, gated model, ...: the library's own message
        raise HubError(f"{repo_id!r} is not a local folder and could not be fetched from the Hugging Face hub: "
                       f"{type(e).__name__}: {e}") from e
