"""Checkpoints named by a Hugging Face hub repository id (``owner/name``) instead of a folder.

``python -m fot.convert``, ``train.py init_from=`` and ``fot.eval`` take either; an id is
downloaded into the hub's cache (a second use takes the cached copy) and the local copy is
used from there on.
"""

from __future__ import annotations

import re
from pathlib import Path

from fot.errors import FotError

HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A hub repository id, ``owner/name``."""

# config, safetensors weights (and their index) and tokenizer files; PyTorch .bin weights only
# where a repository has no safetensors (many hold both)
_FILES = ["*.json", "*.safetensors", "*.txt", "*.model"]


class HubDownloadError(FotError, ValueError):
    """A hub repository id that could not be downloaded."""


def is_hub_repo_id(src: str) -> bool:
    """Whether ``src`` names a hub repository: ``owner/name``, no such local path, and no local
    folder ``owner`` (``runs/hf`` with a folder ``runs`` here is a local path with a typo, whose
    error the caller names, not a repository to download)."""
    if not HUB_REPO_ID.match(src):
        return False
    path = Path(src).expanduser()
    return not path.exists() and not path.parent.is_dir()


def local_folder(src: str) -> Path:
    """``src`` as a local folder: itself, or (:func:`is_hub_repo_id`) the hub repository
    downloaded into the hub's cache.

    Raises:
        HubDownloadError: the download failed (offline, no such repository, no access); the
            message names the hub's error and what to do.
    """
    if not is_hub_repo_id(src):
        return Path(src).expanduser()
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(src, allow_patterns=_FILES))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(src, allow_patterns=["*.bin"]))
        return folder
    except (OSError, ValueError) as err:  # the hub's errors: not found, offline, no access
        reason = " ".join(str(err).split())[:300]
        raise HubDownloadError(
            f"{src!r} is no local folder, and downloading it as a hub repository failed "
            f"({type(err).__name__}: {reason}); check the name, the connection and "
            "HF_HUB_OFFLINE, or download it elsewhere (hf download OWNER/NAME --local-dir DIR) "
            "and pass DIR"
        ) from None
