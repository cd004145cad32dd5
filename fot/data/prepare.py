"""Turn text into a token folder for ``data=tokens``: ``python -m fot.data.prepare --help``.

Inputs, one document each:

* a text file (``.txt``, ``.md``, ...): the whole file is one document;
* a ``.jsonl`` file (or ``.ndjson``, ``.jsonlines``): every line is a document (its
  ``--text-field``, default ``text``);
* a folder: every file under it matching ``--glob`` (recursively, sorted; default ``*.txt``,
  give ``--glob`` several times for several patterns: ``--glob '*.txt' --glob '*.md'``); text,
  ``.jsonl`` and table files (``.json``, ``.csv``, ``.parquet``, ...) under it that no pattern
  matches are named in a warning, with the command that reads them;
* a quoted glob pattern (``'data/**/*.txt'``): every file or folder it matches;
* ``--hf NAME_OR_PATH``: a Hugging Face dataset (``--hf-name``, ``--split``, ``--streaming``,
  ``--data-files`` as for ``datasets.load_dataset``), one document per row; local
  ``.csv``/``.parquet``/``.json`` files are read this way (``--hf csv --data-files a.csv``),
  never as plain text; a folder written by ``save_to_disk`` is read with ``load_from_disk`` (a
  ``Dataset`` as the split ``train``). Where datasets reads plain text files (``--hf text``, or
  a folder of ``.txt`` files), every file is one document, as for a folder given as input.
  datasets picks a loader by the files' extensions, and for ``.md`` it is not the text loader:
  name it (``--hf text --data-files 'notes/**/*.md'``).

Text that is not valid UTF-8 is read with U+FFFD for the bad bytes and a warning naming the
file, as is a lone UTF-16 surrogate in a ``.jsonl`` text or dataset row (an escape such as
``\\ud800`` without its pair: no character), with a warning naming the line; a text file
with NUL bytes (binary, or UTF-16/UTF-32 text) is refused. A file named more than once (by
a folder and a pattern, or through a symbolic link) is read once, with a warning. Hidden
folders and files of a folder (``.git/``, ``.ipynb_checkpoints/``) are skipped, with a
warning. Empty documents are skipped, counted in a warning (an empty file or text, an empty
CSV cell, or a ``null``, which datasets reads as None); a run that would write no training
document (or, with ``--heldout-every``, no held-out one) fails and leaves existing folders
as they were, as does an error, Ctrl-C or SIGTERM part way. Output folders may not lie inside
each other or inside another token folder.

Documents are tokenized with the GPT-2 tokenizer (``fot.tokenizer.get_encoding()``, offline)
without BOS/EOT (the training readers insert one ``<|endoftext|>`` before each document),
staged beside the output folders (:func:`fot.data.tokens.stage_token_documents`) and moved into
place together once all are written; what a prepare killed part way left there is dealt with by
the next one (:func:`fot.data.tokens.clean_ended_writes`). ``--heldout-every K``
moves every K-th document into a second folder for validation (``data.val_path``).

Example::

    python -m fot.data.prepare ~/corpus --glob '*.txt' --out data/corpus \\
        --heldout-every 100 --heldout-out data/corpus_heldout
    python train.py data=tokens data.path=data/corpus data.val_path=data/corpus_heldout
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import glob as globmod
import itertools
import json
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fot.data.hf import TEXT_SUFFIXES
from fot.data.tokens import FILES as TOKEN_FILES
from fot.data.tokens import (
    TokenDocuments,
    is_token_folder,
    replace_folders,
    stage_token_documents,
)
from fot.data.zarr_store import shown_path
from fot.errors import USER_ERRORS, WriteError, cannot_write, parse_args_naming_typos
from fot.interrupt import StopOnSignal, check_stop
from fot.progress import progress_bar, quiet_library_bars

STRUCTURED_SUFFIXES = (
    ".csv",
    ".tsv",
    ".parquet",
    ".arrow",
    ".json",
    ".gz",
    ".bz2",
    ".xz",
    ".zst",
    ".zip",
)
"""Suffixes of files that are not plain text: refused as inputs (they would become one
document of raw bytes or markup); ``--hf csv|parquet|json|arrow --data-files FILE`` reads them."""

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")
"""Suffixes of JSON Lines files: one document per line (its ``--text-field``)."""

_GLOB_CHARS = frozenset("*?[")

_TABLE_LOADERS = {
    ".json": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
"""The ``--hf`` loader that reads files of each table suffix (of :data:`STRUCTURED_SUFFIXES`)."""


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def _decode(data: bytes, where: str) -> str:
    """UTF-8 text of ``data`` without a leading byte-order mark (Windows editors write one);
    invalid bytes become U+FFFD, with a warning naming ``where``."""
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        _warn(
            f"{where} is not valid UTF-8 (byte {data[err.start]:#04x} at offset {err.start}); "
            "invalid bytes were replaced by U+FFFD. Convert the file to UTF-8 first "
            "(e.g. `iconv -f latin1 -t utf-8`) to keep them"
        )
        return data.decode("utf-8", errors="replace")


def _expand_inputs(inputs: list[str]) -> list[Path]:
    """Input paths, with quoted glob patterns (``'data/*.txt'``, ``'data/**/*.md'``) expanded."""
    paths: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_symlink() and not p.exists():
            raise FileNotFoundError(
                f"input {p} is a broken symbolic link (to {os.readlink(p)}); point it at an "
                "existing file or leave it out"
            )
        if p.exists():
            paths.append(p)
        elif _GLOB_CHARS & set(item):
            matches = sorted(globmod.glob(str(p), recursive=True))
            if not matches:
                raise FileNotFoundError(f"input pattern {item!r} matches no file or folder")
            broken = [m for m in matches if not os.path.exists(m)]  # broken symbolic links
            if broken:
                _warn(f"{len(broken)} broken symbolic link(s) matching {item!r} skipped")
            paths.extend(Path(m) for m in matches if m not in broken)
        else:
            raise FileNotFoundError(f"input {shown_path(p)} does not exist")
    return paths


def _row_text(row: dict, text_field: str, where: str) -> str | None:
    """The ``text_field`` string of a JSON line or dataset row, ``None`` for a null (an empty
    document, skipped); ``where`` names the row in errors (a missing field, or a value that is
    no string: a number, a list)."""
    if text_field not in row:
        raise ValueError(
            f"{where} has no field {text_field!r} (fields: {sorted(row)}); set --text-field "
            "to the field that holds the text"
        )
    text = row[text_field]
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(
            f"{where}: field {text_field!r} is {text!r} ({type(text).__name__}), not a string; "
            "fix or remove that row, or set --text-field"
        )
    from fot.tokenizer import replace_lone_surrogates

    text, lone = replace_lone_surrogates(text)
    if lone:
        _warn(
            f"{where}: field {text_field!r} holds {lone} lone UTF-16 surrogate(s) (a \\ud800-"
            "\\udfff escape without its pair, no character); each was read as U+FFFD"
        )
    return text


def _warn_nulls(nulls: int, where: str, what: str) -> None:
    if nulls:
        _warn(f"{nulls} row(s) of {where} had no text ({what}) and were skipped as empty documents")


def _jsonl_texts(f: Path, text_field: str) -> Iterator[str]:
    nulls = 0
    with open(f, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            line = _decode(raw, f"{f}:{n}")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{f}:{n} is not valid JSON ({err}): {line[:80]!r}") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{f}:{n} is a JSON {type(row).__name__}, not an object; every line of a "
                    f'.jsonl file must be an object such as {{"{text_field}": "..."}}'
                )
            text = _row_text(row, text_field, f"{f}:{n}")
            if text is None:
                nulls += 1
            else:
                yield text
    _warn_nulls(nulls, str(f), "null")


def iter_texts(
    inputs: list[str],
    *,
    glob: str | list[str] = "*.txt",
    text_field: str = "text",
) -> Iterator[str]:
    """Yield documents from files, ``.jsonl`` files and folders (see the module docstring).

    Args:
        inputs: files, folders, or quoted glob patterns (``'data/**/*.txt'``).
        glob: pattern(s) of the files to read inside folders (recursively, sorted).
        text_field: the field of ``.jsonl`` rows that holds the text.

    Raises:
        FileNotFoundError: an input or pattern that matches nothing.
        ValueError: a structured file given as text, or a bad ``.jsonl`` line (named by
            file and line number).
    """
    globs = [glob] if isinstance(glob, str) else list(glob)
    seen: set[Path] = set()  # a file named twice (folder + pattern, symlink) is read once
    repeated = 0
    for p in _expand_inputs(inputs):
        if p.is_dir():
            matched = {f for g in globs for f in p.rglob(g)}
            # .ipynb_checkpoints/, .git/, editors' .swp files: copies and tools' files, not the
            # corpus (datasets leaves them out of a folder too)
            hidden = sorted(f for f in matched if _hidden(f, p) and f.is_file())
            if hidden:
                _warn(
                    f"{len(hidden)} file(s) in hidden folders or with hidden names under {p} "
                    f"skipped (e.g. {hidden[0]}); name such a file as an input to read it"
                )
            matched = {f for f in matched if not _hidden(f, p)}
            broken = sorted(f for f in matched if f.is_symlink() and not f.exists())
            if broken:
                _warn(f"{len(broken)} broken symbolic link(s) under {p} skipped (e.g. {broken[0]})")
            files = sorted(f for f in matched if f.is_file())
            left_out = _left_out_files(p, globs, matched)
            if not files:
                # the files of data it holds, with the command that reads them, where it has any
                raise FileNotFoundError(
                    f"no files matching {' or '.join(map(repr, globs))} under {p}; "
                    + (
                        left_out
                        or "change --glob (give it several times for several patterns, e.g. "
                        "--glob '*.txt' --glob '*.md')"
                    )
                )
            if left_out:
                _warn(left_out)
        else:
            files = [p]
        for f in files:
            real = f.resolve()
            if real in seen:
                repeated += 1
                continue
            seen.add(real)
            if f.suffix.lower() in JSONL_SUFFIXES:
                yield from _jsonl_texts(f, text_field)
            elif f.suffix.lower() in STRUCTURED_SUFFIXES:
                hint = _TABLE_LOADERS.get(f.suffix.lower(), "json")
                raise ValueError(
                    f"{f} is not a plain text file (suffix {f.suffix}); it would become one "
                    f"document of raw bytes. Read it as a dataset with `--hf {hint} "
                    f"--data-files {f}` (and --text-field), or give .txt/.md/.jsonl files"
                )
            else:
                data = f.read_bytes()
                if b"\0" in data:
                    raise ValueError(
                        f"{f} holds NUL bytes (first at offset {data.index(0)}): it is binary, or "
                        "text in UTF-16/UTF-32, not UTF-8 text. Leave it out (narrow --glob or "
                        "the pattern), or convert it (e.g. `iconv -f utf-16 -t utf-8`)"
                    )
                yield _decode(data, str(f))
    if repeated:
        _warn(
            f"{repeated} input file(s) were named more than once (by a folder and a pattern, "
            "overlapping patterns or a symbolic link) and were read once"
        )


def _hidden(path: Path, folder: Path) -> bool:
    """Whether ``path`` under ``folder`` lies in a hidden folder or has a hidden name (a part
    starting with a dot)."""
    return any(part.startswith(".") for part in path.relative_to(folder).parts)


def _left_out_files(folder: Path, globs: list[str], matched: set[Path]) -> str | None:
    """A warning naming the files of data under ``folder`` that none of ``globs`` reads (text,
    JSON Lines and table files, none of a token folder), with the command that reads
    them: more ``--glob`` patterns for text and ``.jsonl`` files, ``--hf <loader>`` for tables
    (a token folder of their own); ``None`` where the folder holds no such file."""
    kinds = (*TEXT_SUFFIXES, *JSONL_SUFFIXES, *_TABLE_LOADERS)
    left = sorted(
        f
        for f in folder.rglob("*")
        if f.suffix.lower() in kinds
        and f not in matched
        and not _hidden(f, folder)
        and f.is_file()
        and not is_token_folder(f.parent)
    )
    if not left:
        return None
    shown = ", ".join(str(f) for f in left[:3]) + (
        f" and {len(left) - 3} more" if len(left) > 3 else ""
    )
    read = sorted({f.suffix for f in left if f.suffix.lower() not in _TABLE_LOADERS})
    tables = sorted({f.suffix for f in left if f.suffix.lower() in _TABLE_LOADERS})
    fixes = []
    if read:
        patterns = " ".join(f"--glob {shlex.quote(g)}" for g in [*globs, *(f"*{k}" for k in read)])
        fixes.append(
            f"To read the {' and '.join(read)} files too: `python -m fot.data.prepare "
            f"{shlex.quote(str(folder))} {patterns} --out <folder>`"
        )
    if tables:
        commands = "; ".join(
            f"`python -m fot.data.prepare --hf {_TABLE_LOADERS[k.lower()]} --data-files "
            f"{shlex.quote(f'{folder}/**/*{k}')} --out <folder>`"
            for k in tables
        )
        fixes.append(
            f"The {' and '.join(tables)} files are read as datasets, each kind into a token "
            f"folder of its own (--text-field names their text column): {commands}"
        )
    globs_shown = " ".join(f"--glob {shlex.quote(g)}" for g in globs)
    return (
        f"{folder}: {globs_shown} leaves out {len(left)} file(s) of data under it ({shown}). "
        + ". ".join(fixes)
    )


def iter_hf_texts(
    path: str,
    *,
    name: str | None = None,
    split: str = "train",
    streaming: bool = False,
    data_files: list[str] | None = None,
    text_field: str = "text",
) -> Iterator[str]:
    """Yield the ``text_field`` of every row of a Hugging Face dataset (rows whose text is
    None are skipped, with a warning counting them); a text loader gives one row per file."""
    from fot.data.hf import HFDataset

    dataset = HFDataset(
        path,
        name=name,
        data_files=data_files,
        streaming=streaming,
        where=f"dataset {path}",
        files_option="--data-files FILE ...",
        streaming_option="--streaming",
        loader_hint=lambda loader, files: (
            f"--hf {loader} --data-files " + " ".join(map(shlex.quote, files))
        ),
    )
    if left_out := dataset.left_out_files():
        _warn(left_out)
    rows = dataset.guard(lambda: iter(dataset.load(split, "--split")), split)
    nulls = 0
    for n in itertools.count():
        try:
            row = next(rows)
        except StopIteration:
            break
        except Exception as err:  # a bad file met while streaming
            new = dataset.explain(err, split)
            if new is None:
                raise
            raise new from err
        # (datasets fills a field missing from some rows with None)
        text = _row_text(row, text_field, f"row {n} (counting from 0) of dataset {path}")
        if text is None:
            nulls += 1
        else:
            yield text
    _warn_nulls(nulls, f"dataset {path}", "None: a null, or a field missing from the row")


def tokenize(
    texts: Iterator[str], *, batch: int = 256, max_docs: int | None = None
) -> Iterator[np.ndarray]:
    """GPT-2 token ids (uint16) of each text, without BOS/EOT; empty texts are skipped.

    ``max_docs`` counts the documents yielded (empty texts do not count); no text past the
    last one is read.
    """
    from fot.tokenizer import get_encoding

    if max_docs is not None and max_docs < 1:
        raise ValueError(f"--max-docs must be >= 1 (or left out for all), got {max_docs}")
    enc = get_encoding()
    buf: list[str] = []

    def flush() -> Iterator[np.ndarray]:
        for ids in enc.encode_ordinary_batch(buf):
            if ids:
                yield np.asarray(ids, dtype=np.uint16)
        buf.clear()

    kept = empty = 0
    for text in texts:
        if not text:  # tokenizes to nothing; any other text has at least one token
            empty += 1
            continue
        buf.append(text)
        kept += 1
        if len(buf) >= batch:
            yield from flush()
        if max_docs is not None and kept >= max_docs:
            break
    yield from flush()
    if empty:
        _warn(f"{empty} empty text(s) (an empty file, or an empty text field) skipped")


def _absolute(path: str | Path) -> Path:
    """``path`` made absolute, ``~`` expanded and ``.``/``..`` collapsed (symlinks kept)."""
    return Path(os.path.abspath(Path(path).expanduser()))


def _check_replaceable(path: str | Path, flag: str) -> None:
    """Refuse an output path that exists and is not a token folder (it would be deleted), or
    a token folder that holds anything else (a run's folder, the input texts): replacing it
    deletes the whole folder.

    Raises:
        ValueError: ``path`` is a file, a folder without a ``fot-tokens`` ``meta.json``, or a
            token folder with other files or folders in it.
    """
    p = _absolute(path)
    blocker = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag} {p} lies under the file {blocker}; choose a folder path")
    inside = next((a for a in p.parents if is_token_folder(a)), None)
    if inside is not None:
        raise ValueError(
            f"{flag} {p} lies inside the token folder {inside}, which is deleted whenever that "
            "folder is replaced; choose a folder outside it"
        )
    if not p.exists() and not p.is_symlink():
        return
    if p.is_symlink():  # replacing it would put a folder where the link is, not at its target
        raise ValueError(
            f"{flag} {p} is a symbolic link (to {os.readlink(p)}): the new token folder would "
            f"replace the link, not the folder it points to. Pass the folder itself, "
            f"{flag} {p.resolve()}, or a new path"
        )
    if not is_token_folder(p):
        raise ValueError(
            f"{flag} {p} exists and is not a token folder; it would be replaced, and everything "
            f"in it deleted. Choose a new folder for {flag} (an existing token folder is "
            "replaced), or delete it yourself first"
        )
    others = sorted(name for name in os.listdir(p) if name not in TOKEN_FILES)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ValueError(
            f"{flag} {p} is a token folder that also holds {shown}, which replacing it would "
            f"delete; move {'them' if len(others) > 1 else 'it'} out of it first, or choose a "
            f"new folder for {flag}"
        )


def prepare(
    docs: Iterator[np.ndarray],
    out: str | Path,
    *,
    heldout_every: int = 0,
    heldout_out: str | Path | None = None,
    source: str = "",
) -> dict[str, int]:
    """Write token documents to ``out`` (and every ``heldout_every``-th one to ``heldout_out``).

    Held-out documents are kept in memory until the end (they are a small fraction). The
    existing folders are replaced only once both new ones are complete: an error or Ctrl-C
    part way leaves them (and no half-written folder) behind.

    Returns:
        Counts: ``{"train_docs", "train_tokens", "heldout_docs", "heldout_tokens"}``.

    Raises:
        ValueError: bad ``heldout_every``/``heldout_out``, or an output path that exists and
            is not a token folder (checked before any document is read or written); no
            training document, or (with ``heldout_every``) no held-out one.
    """
    if heldout_every and heldout_out is None:
        raise ValueError("--heldout-every needs --heldout-out (where held-out documents go)")
    if heldout_every < 0 or heldout_every == 1:
        raise ValueError(f"--heldout-every must be 0 (none) or >= 2, got {heldout_every}")
    if heldout_out is not None and not heldout_every:
        raise ValueError(
            f"--heldout-out {heldout_out} needs --heldout-every K (hold out every K-th document, "
            "K >= 2); without it nothing would be written there"
        )
    _check_replaceable(out, "--out")
    if heldout_out is not None:
        _check_replaceable(heldout_out, "--heldout-out")
        out_r, held_r = Path(out).expanduser().resolve(), Path(heldout_out).expanduser().resolve()
        if out_r == held_r:
            raise ValueError(
                f"--heldout-out and --out are the same folder ({out}): the held-out documents "
                "would replace the training ones; give --heldout-out a folder of its own"
            )
        if out_r in held_r.parents or held_r in out_r.parents:
            raise ValueError(
                f"--out {out} and --heldout-out {heldout_out} lie one inside the other: "
                "replacing the outer folder deletes the inner one; give them separate folders "
                "(e.g. data/corpus and data/corpus_heldout)"
            )
    held: list[np.ndarray] = []

    def train_docs() -> Iterator[np.ndarray]:
        i = -1
        for i, d in enumerate(docs):
            if heldout_every and i % heldout_every == heldout_every - 1:
                held.append(d)
            else:
                yield d
        # Checked here, before the new folder replaces an old one: an empty token folder
        # would only fail later, in train.py.
        if i + 1 - len(held) == 0:
            raise ValueError(
                f"no training documents: the inputs hold {i + 1} non-empty document(s)"
                + (f", all held out by --heldout-every {heldout_every}" if held else "")
                + "; nothing was written. Check the inputs (empty files are skipped)"
            )
        if heldout_every and not held:
            raise ValueError(
                f"--heldout-every {heldout_every} holds out no document: the inputs hold only "
                f"{i + 1}; nothing was written. Use a --heldout-every from 2 to {i + 1}, or "
                "drop --heldout-every/--heldout-out"
            )

    # Both folders are staged under hidden names and moved into place together once both are
    # written, so an error or Ctrl-C never pairs a new training folder with an old held-out
    # one (whose documents could overlap it), or the other way round.
    # (absolute: `--out .` gets a name to stage the new folder beside)
    dests = [_absolute(d) for d in ([out, heldout_out] if heldout_every else [out])]
    staged: list[tuple[Path, Path]] = []
    writing = out
    try:
        staged.append((stage_token_documents(dests[0], train_docs(), source=source), dests[0]))
        tr = TokenDocuments(staged[0][0])
        stats = {
            "train_docs": len(tr),
            "train_tokens": tr.num_tokens,
            "heldout_docs": 0,
            "heldout_tokens": 0,
        }
        if heldout_every:
            writing = heldout_out
            folder = stage_token_documents(
                dests[1], held, source=source, heldout_every=heldout_every
            )
            staged.append((folder, dests[1]))
            hv = TokenDocuments(folder)
            stats.update(heldout_docs=len(hv), heldout_tokens=hv.num_tokens)
        check_stop()
        replace_folders(staged)
    except WriteError as err:  # named by its absolute path: name the folder as the user gave it
        kept = "Nothing was replaced, and nothing half-written is left"
        raise cannot_write(writing, err, kept) or err from err.__cause__
    finally:
        for folder, _ in staged:
            shutil.rmtree(folder, ignore_errors=True)
    return stats


def _positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _counted(docs: Iterator[np.ndarray], bar: Any) -> Iterator[np.ndarray]:
    """``docs``, counted on the progress bar ``bar`` (documents, and tokens beside them)."""
    tokens = 0
    for doc in docs:
        tokens += len(doc)
        bar.update()
        if bar.n % 256 == 0:
            bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
        yield doc
    bar.set_postfix(tokens=f"{tokens:,}", refresh=False)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(
        prog="python -m fot.data.prepare",
        description="Tokenize text files, folders, .jsonl files or an HF dataset (GPT-2) into a "
        "token folder for `train.py data=tokens data.path=<out>`.",
    )
    ap.add_argument(
        "inputs",
        nargs="*",
        help="text files (one document each), .jsonl files (one per line), folders, or quoted "
        "glob patterns such as 'data/**/*.txt'",
    )
    ap.add_argument(
        "--out",
        required=True,
        help="token folder to write (an existing token folder is replaced; any other "
        "existing path, or a token folder holding other files, is refused)",
    )
    ap.add_argument(
        "--glob",
        action="append",
        help="file pattern inside folders (default *.txt); give it several times for several "
        "patterns, e.g. --glob '*.txt' --glob '*.md'",
    )
    ap.add_argument("--text-field", default="text", help="text field of .jsonl / HF rows")
    ap.add_argument("--hf", help="HF dataset name or local path (instead of inputs)")
    ap.add_argument("--hf-name", help="HF dataset configuration name")
    ap.add_argument("--split", default="train", help="HF split (default train)")
    ap.add_argument("--streaming", action="store_true", help="stream the HF dataset")
    ap.add_argument("--data-files", nargs="*", help="data_files for the HF loader")
    ap.add_argument(
        "--max-docs", type=_positive_int, help="stop after this many non-empty documents"
    )
    ap.add_argument("--heldout-every", type=int, default=0, help="hold out every K-th document")
    ap.add_argument("--heldout-out", help="token folder for the held-out documents")
    args = parse_args_naming_typos(ap, argv, intermixed=True)  # inputs before or after options
    if bool(args.inputs) == bool(args.hf):
        ap.error("give either input files/folders or --hf (not both, not neither)")
    hf_only = {
        "--hf-name": args.hf_name is not None,
        "--split": args.split != "train",
        "--streaming": args.streaming,
        "--data-files": args.data_files is not None,
    }
    if args.inputs and any(hf_only.values()):
        ap.error(
            f"{', '.join(k for k, v in hf_only.items() if v)}: for --hf datasets only, not for "
            "input files (for local .csv/.parquet/.json: --hf csv --data-files FILE)"
        )
    if args.hf:
        quiet_library_bars()  # datasets' "Generating train split" in a log file
        texts = iter_hf_texts(
            args.hf,
            name=args.hf_name,
            split=args.split,
            streaming=args.streaming,
            data_files=args.data_files,
            text_field=args.text_field,
        )
        source = f"hf:{args.hf}"
    else:
        texts = iter_texts(args.inputs, glob=args.glob or ["*.txt"], text_field=args.text_field)
        source = ",".join(args.inputs)
    # `timeout`, Slurm and Docker stop with SIGTERM: clean up as for Ctrl-C (no temp folders).
    stop = StopOnSignal((signal.SIGTERM, signal.SIGINT))
    # shown once the job takes more than 2 s (a large corpus takes minutes to hours)
    bar = progress_bar(total=args.max_docs, desc="tokenize", unit="doc", delay=2)
    try:
        with stop, contextlib.closing(bar):
            stats = prepare(
                stop.checked(_counted(tokenize(texts, max_docs=args.max_docs), bar)),
                args.out,
                heldout_every=args.heldout_every,
                heldout_out=args.heldout_out,
                source=source,
            )
    except (*USER_ERRORS, KeyError) as err:  # as train.py: one line (an unreachable hub too)
        message = err.args[0] if isinstance(err, KeyError) else err
        print(f"{ap.prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"interrupted: {args.out} was not replaced (nothing half-written is left)",
            file=sys.stderr,
        )
        return 130
    if stop.signum is not None:  # held while the new folders moved into place (they did)
        print(
            f"{signal.Signals(stop.signum).name} came while the new folders were moved into "
            "place: the job had finished, and they are in place",
            file=sys.stderr,
        )
    print(json.dumps({"out": str(args.out), **stats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
