"""A folder of token documents: the on-disk format that ``fot.data.prepare`` writes.

Layout of a token folder::

    tokens.bin        all documents' token ids back to back, uint16 (GPT-2 ids < 65536)
    doc_offsets.npy   int64 [N + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
    meta.json         {"format": "fot-tokens", "version": 1, "num_documents", "num_tokens",
                       "dtype": "uint16", "tokenizer": "gpt2", ...}

Documents hold their text's tokens only; the BOS convention (an ``<|endoftext|>`` before each
document) is applied by the readers, not stored. ``tokens.bin`` is read through a memmap, so
opening a folder costs nothing and memory stays constant.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from fot.errors import cannot_write
from fot.staging import (
    ended_earlier_writers,
    ended_writers,
    remove_and_log,
    set_aside_name,
    writer_tag,
)

logger = logging.getLogger(__name__)

FORMAT = "fot-tokens"
VERSION = 1
FILES = ("tokens.bin", "doc_offsets.npy", "meta.json")
"""The files of a token folder (the layout above)."""


def is_token_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a token folder: a folder whose ``meta.json`` says ``fot-tokens``."""
    p = Path(path)
    try:
        return p.is_dir() and json.loads((p / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class TokenDocuments(Sequence):
    """Read-only view of a token folder; ``docs[i]`` is document i as a uint16 array."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            arrays = sorted(
                f.name for f in self.path.glob("*.zarr") if f.name in ("train.zarr", "heldout.zarr")
            )
            read_as = (
                f" It holds {' and '.join(arrays)}: for LongCrawl64 use data=longcrawl64 "
                f"data.path={self.path}, or name an array itself (data.path="
                f"{self.path / ('train.zarr' if 'train.zarr' in arrays else arrays[0])} "
                "data.text_escaping=json: LongCrawl64's ids are of JSON-escaped text)."
                if arrays
                else ""
            )
            if not arrays and self.path.is_dir():
                from fot.data.hf import saved_to_disk

                if saved := saved_to_disk(self.path):
                    read_as = (
                        f" It holds a {saved} written by save_to_disk: train on it with "
                        f"data=hf data.path={self.path}."
                    )
            if put_back := put_back_hint(self.path):
                raise FileNotFoundError(f"token folder {self.path} does not exist: {put_back}")
            raise FileNotFoundError(
                f"{self.path} is not a token folder (no meta.json). Create one with "
                f"`python -m fot.data.prepare --help`.{read_as}"
            )
        damaged = (
            "the token folder is damaged or incomplete (an interrupted copy?): copy it again, or "
            "write it again with `python -m fot.data.prepare`"
        )
        try:
            self.meta = json.loads(meta_file.read_text())
        except (ValueError, OSError) as err:
            raise ValueError(f"{meta_file} is not readable JSON ({err}); {damaged}") from None
        if not isinstance(self.meta, dict) or self.meta.get("format") != FORMAT:
            found = self.meta.get("format") if isinstance(self.meta, dict) else self.meta
            raise ValueError(f"{meta_file} has format {found!r}, expected {FORMAT!r}")
        if self.meta.get("dtype", "uint16") != "uint16":
            # not "damaged": a folder of another writer, whose tokens.bin would be misread
            raise ValueError(
                f"{meta_file} says dtype {self.meta['dtype']!r}, but token folders hold uint16 "
                "ids (GPT-2's vocabulary); write the folder with `python -m fot.data.prepare`"
            )
        offsets_file = self.path / "doc_offsets.npy"
        try:
            self.offsets = np.load(offsets_file)
        except FileNotFoundError:
            raise FileNotFoundError(f"{offsets_file} is missing; {damaged}") from None
        except (ValueError, OSError, EOFError) as err:
            raise ValueError(f"{offsets_file} is not a readable array ({err}); {damaged}") from None
        if not (
            self.offsets.ndim == 1
            and len(self.offsets) >= 1
            and np.issubdtype(self.offsets.dtype, np.integer)
            and self.offsets[0] == 0
            and np.all(np.diff(self.offsets) >= 0)
        ):
            raise ValueError(
                f"{offsets_file} does not hold document offsets (1-D integers from 0, never "
                f"decreasing); {damaged}"
            )
        n_tokens = int(self.offsets[-1])
        # a meta.json of another folder (files copied over from two writes) may also name
        # another tokenizer or text escaping: the counts tell it apart
        for key, count in (("num_documents", len(self.offsets) - 1), ("num_tokens", n_tokens)):
            if key in self.meta and self.meta[key] != count:
                raise ValueError(
                    f"{meta_file} says {key}={self.meta[key]!r}, but {offsets_file.name} counts "
                    f"{count}: the files are of two different writes; {damaged}"
                )
        tokens_file = self.path / "tokens.bin"
        size = tokens_file.stat().st_size if tokens_file.is_file() else None
        if size != 2 * n_tokens and (n_tokens or size is not None):
            have = "is missing" if size is None else f"has {size} bytes"
            raise ValueError(
                f"{tokens_file} {have}, but doc_offsets.npy counts {n_tokens} tokens "
                f"({2 * n_tokens} bytes of uint16); {damaged}"
            )
        self.tokens = (
            np.memmap(self.path / "tokens.bin", dtype=np.uint16, mode="r", shape=(n_tokens,))
            if n_tokens
            else np.zeros(0, dtype=np.uint16)
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        i %= len(self)
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def num_tokens(self) -> int:
        """Total number of tokens over all documents."""
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        """``[N]`` int64 document lengths."""
        return np.diff(self.offsets)


def write_token_documents(
    path: str | os.PathLike, docs: Iterable[Sequence[int] | np.ndarray], **meta: object
) -> TokenDocuments:
    """Write documents as a token folder, atomically (:func:`stage_token_documents`, then
    renamed into place by :func:`replace_folder`).

    Args:
        path: destination folder; replaced if it exists.
        docs: documents as sequences/arrays of token ids in ``[0, 65535]``.
        **meta: extra JSON-serialisable fields recorded in ``meta.json`` (e.g. source).

    Returns:
        The written folder, opened.

    Raises:
        fot.errors.WriteError: a write failed (a full disk): ``path`` is left as it was.
    """
    dest = Path(path)
    replace_folder(stage_token_documents(dest, docs, **meta), dest)
    return TokenDocuments(dest)


def stage_token_documents(
    path: str | os.PathLike, docs: Iterable[Sequence[int] | np.ndarray], **meta: object
) -> Path:
    """Write documents as a token folder staged beside ``path``, under the hidden name
    ``.{name}.tmp-{host}.{pid}`` (:func:`fot.staging.writer_tag`), for :func:`replace_folders`
    to move into place. An error or Ctrl-C leaves no staged folder.

    What writes of ``path`` by processes that have ended (killed: SIGKILL, the OOM killer) left
    is dealt with first (:func:`clean_ended_writes`).

    Args:
        path: the token folder the staged one is to replace (or become).
        docs: documents as sequences/arrays of token ids in ``[0, 65535]``.
        **meta: extra JSON-serialisable fields recorded in ``meta.json`` (e.g. source).

    Returns:
        The staged folder.

    Raises:
        fot.errors.WriteError: a write failed (a full disk): nothing is left of it.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_ended_writes(dest)
    tmp = dest.with_name(f".{dest.name}.tmp-{writer_tag()}")
    tmp.mkdir()
    offsets = [0]
    writing = False  # while `docs` reads (its OSError is the input's), not while writing
    try:
        with open(tmp / "tokens.bin", "wb") as f:
            for doc in docs:
                arr = np.asarray(doc)
                if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint16).max):
                    raise ValueError(
                        f"token ids must lie in [0, 65535] to be stored as uint16, got range "
                        f"[{arr.min()}, {arr.max()}]"
                    )
                writing = True
                f.write(arr.astype(np.uint16).tobytes())
                writing = False
                offsets.append(offsets[-1] + arr.size)
            writing = True  # closing the file writes what is buffered
        np.save(tmp / "doc_offsets.npy", np.asarray(offsets, dtype=np.int64))
        info = {
            "format": FORMAT,
            "version": VERSION,
            "num_documents": len(offsets) - 1,
            "num_tokens": offsets[-1],
            "dtype": "uint16",
            "tokenizer": "gpt2",
            **meta,
        }
        (tmp / "meta.json").write_text(json.dumps(info, indent=2) + "\n")
    except BaseException as err:  # an error in `docs`, or Ctrl-C: leave no half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        error = cannot_write(dest, err) if writing and isinstance(err, Exception) else None
        if error is None:
            raise
        raise error from err  # a full disk: one line naming the folder (it was not replaced)
    return tmp


def clean_ended_writes(path: str | os.PathLike) -> None:
    """Deal with what writes of the token folder ``path`` by processes that have ended (killed
    while writing or replacing it, :mod:`fot.staging`) left beside it: their staged folders
    (``.{name}.tmp-{host}.{pid}``) are removed, with a line in the log, as are the folders of
    an earlier ``path`` that they set aside while replacing it (``.{name}.old-{host}.{pid}``)
    that hold no whole token folder (a delete cut short). The others are kept and named in the
    log with what to do: a kill between setting the earlier folder aside and moving the new one
    in leaves that folder its only copy. The folders an earlier fot staged (without the host:
    prepare's ``.{name}.new-{pid}``, the sample cache's ``.{name}.{pid}``, and the
    ``..{staged}.tmp-{pid}`` and ``..{staged}.old-{pid}`` that writing them left) hold no copy
    of ``path``: they are removed in the same line, by the rules of
    :func:`fot.staging.ended_earlier_writers`."""
    dest = Path(path)
    asides = ended_writers(dest.parent, f".{dest.name}.old-")
    whole = [left for left in asides if _is_whole(left.path)]
    staged = ended_writers(dest.parent, f".{dest.name}.tmp-")
    earlier = []  # an earlier fot's staged folders, and what its writes of them left
    for name in (f".{dest.name}.new-", f".{dest.name}."):  # prepare's; the sample cache's
        earlier += [(name, ""), (f".{name}", ".tmp-", ""), (f".{name}", ".old-", "")]
    remove_and_log(
        [
            *staged,
            *(left for left in asides if left not in whole),
            *ended_earlier_writers(dest.parent, *earlier),
        ],
        logger,
        f"writes of {dest}",
    )
    for left in whole:
        logger.warning(
            "kept %s: it holds the token folder %s as it was before %s set it aside to replace "
            "it and did not finish (it ended; killed?), and may be its only copy. To keep it, "
            "move it to a folder of its own (mv '%s' <folder>); else delete it (rm -r '%s')",
            left.path,
            dest,
            left.writer(),
            left.path,
            left.path,
        )


def put_back_hint(path: str | os.PathLike) -> str | None:
    """Where the token folder ``path`` is missing because a write killed while replacing it
    (:func:`replace_folders`) left it set aside beside it, whole (``.{name}.old-{host}.{pid}``,
    kept by :func:`clean_ended_writes`): a sentence naming that copy and the ``mv`` that puts
    it back. ``None`` where ``path`` exists or no such copy lies beside it."""
    dest = Path(os.path.abspath(Path(path).expanduser()))
    if os.path.lexists(dest):
        return None
    copies = [
        left for left in ended_writers(dest.parent, f".{dest.name}.old-") if _is_whole(left.path)
    ]
    if not copies:
        return None
    if len(copies) == 1:
        held, back = f"{copies[0].path} holds", shlex.quote(str(copies[0].path))
    else:
        held, back = f"{', '.join(str(c.path) for c in copies)} hold", "<the one to keep>"
    return (
        f"{held} it as it was before {'; '.join(c.writer() for c in copies)} set it aside to "
        f"replace it and did not finish (killed?): put it back with `mv {back} "
        f"{shlex.quote(str(dest))}`."
    )


def _is_whole(folder: Path) -> bool:
    """Whether ``folder`` is a token folder that opens (its files all there)."""
    try:
        TokenDocuments(folder)
    except (OSError, ValueError):
        return False
    return True


def replace_folder(src: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Move folder ``src`` to ``dest``, replacing (and deleting) an existing ``dest``
    (:func:`replace_folders` of one pair)."""
    replace_folders([(src, dest)])


def replace_folders(pairs: Sequence[tuple[str | os.PathLike, str | os.PathLike]]) -> None:
    """Move each folder ``src`` to its ``dest``, replacing (and deleting) an existing ``dest``.

    Every old ``dest`` is renamed aside first, so no ``dest`` is ever a half-written folder,
    and all are in place before the old ones are deleted. Ctrl-C or SIGTERM under a
    :class:`fot.interrupt.StopOnSignal` is held until the end (:func:`fot.interrupt.signals_held`):
    a signal while a large old folder was deleted left the new folders of some pairs in place
    and others not (a new held-out folder beside an old training folder that holds its
    documents), and the old folder hidden beside them.
    """
    from fot.interrupt import signals_held

    moved: list[tuple[Path, Path, Path | None]] = []  # (src, dest, old dest set aside)
    with signals_held():
        try:
            for src, dest in pairs:
                src, dest = Path(src), Path(dest)
                aside = set_aside_name(dest.parent, f".{dest.name}.old-") if dest.exists() else None
                moved.append((src, dest, aside))  # before the renames: a rollback sees both
                if aside is not None:
                    dest.rename(aside)
                src.rename(dest)
        except BaseException:
            # put back what moved (a failed rename of a later pair, e.g. a full disk): every
            # dest is its old folder again, every src where it was; each step on its own, so
            # that one failing does not leave the others undone
            for src, dest, aside in reversed(moved):
                if not src.exists() and dest.exists():
                    with contextlib.suppress(OSError):
                        dest.rename(src)
                if aside is not None and aside.exists() and not dest.exists():
                    with contextlib.suppress(OSError):
                        aside.rename(dest)
            raise
        for _, _, aside in moved:
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
