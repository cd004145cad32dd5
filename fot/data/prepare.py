"""Turn text into a token folder for ``data=tokens``: ``python -m fot.data.prepare --help``.

Inputs, one document each:

* a text file (``.txt``, ``.md``, ...): the whole file is one document;
* a ``.jsonl`` file: every line is a document (its ``--text-field``, default ``text``);
* a folder: every file under it matching ``--glob`` (recursively, sorted);
* ``--hf NAME_OR_PATH``: a Hugging Face dataset (``--hf-name``, ``--split``, ``--streaming``,
  ``--data-files`` as for ``datasets.load_dataset``).

Documents are tokenized with the GPT-2 tokenizer (``fot.tokenizer.get_encoding()``, offline)
without BOS/EOT (the training readers insert one ``<|endoftext|>`` before each document) and
written atomically with :func:`fot.data.tokens.write_token_documents`. ``--heldout-every K``
moves every K-th document into a second folder for validation (``data.val_path``).

Example::

    python -m fot.data.prepare ~/corpus --glob '*.txt' --out data/corpus \\
        --heldout-every 100 --heldout-out data/corpus_heldout
    python train.py data=tokens data.path=data/corpus data.val_path=data/corpus_heldout
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fot.data.tokens import FORMAT, write_token_documents


def iter_texts(
    inputs: list[str],
    *,
    glob: str = "*.txt",
    text_field: str = "text",
) -> Iterator[str]:
    """Yield documents from files, ``.jsonl`` files and folders (see the module docstring)."""
    for item in inputs:
        p = Path(item).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"input {p} does not exist")
        files = sorted(f for f in p.rglob(glob) if f.is_file()) if p.is_dir() else [p]
        if p.is_dir() and not files:
            raise FileNotFoundError(f"no files matching {glob!r} under {p}; change --glob")
        for f in files:
            if f.suffix == ".jsonl":
                with open(f, encoding="utf-8") as fh:
                    for n, line in enumerate(fh, 1):
                        if not line.strip():
                            continue
                        row = json.loads(line)
                        if text_field not in row:
                            raise KeyError(
                                f"{f}:{n} has no field {text_field!r} (fields: {sorted(row)}); "
                                "set --text-field"
                            )
                        yield row[text_field]
            else:
                yield f.read_text(encoding="utf-8", errors="replace")


def iter_hf_texts(
    path: str,
    *,
    name: str | None = None,
    split: str = "train",
    streaming: bool = False,
    data_files: list[str] | None = None,
    text_field: str = "text",
) -> Iterator[str]:
    """Yield the ``text_field`` of every row of a Hugging Face dataset."""
    import datasets

    ds = datasets.load_dataset(
        path, name=name, split=split, streaming=streaming, data_files=data_files
    )
    for row in ds:
        if text_field not in row:
            raise KeyError(f"dataset rows have fields {sorted(row)}; set --text-field")
        yield row[text_field]


def tokenize(
    texts: Iterator[str], *, batch: int = 256, max_docs: int | None = None
) -> Iterator[np.ndarray]:
    """GPT-2 token ids (uint16) of each text, without BOS/EOT; empty texts are skipped."""
    from fot.tokenizer import get_encoding

    enc = get_encoding()
    buf: list[str] = []

    def flush() -> Iterator[np.ndarray]:
        for ids in enc.encode_ordinary_batch(buf):
            if ids:
                yield np.asarray(ids, dtype=np.uint16)
        buf.clear()

    for done, text in enumerate(texts):
        if max_docs is not None and done >= max_docs:
            break
        buf.append(text)
        if len(buf) >= batch:
            yield from flush()
    yield from flush()


def _check_replaceable(path: str | Path, flag: str) -> None:
    """Refuse an output path that exists and is not a token folder (it would be deleted).

    Raises:
        ValueError: ``path`` is a file, or a folder without a ``fot-tokens`` ``meta.json``.
    """
    p = Path(path).expanduser()
    if not p.exists() and not p.is_symlink():
        return
    meta = p / "meta.json"
    try:
        fmt = json.loads(meta.read_text()).get("format") if p.is_dir() else None
    except (OSError, ValueError, AttributeError):
        fmt = None
    if fmt != FORMAT:
        raise ValueError(
            f"{flag} {p} exists and is not a token folder; it would be replaced, and everything "
            f"in it deleted. Choose a new folder for {flag} (an existing token folder is "
            "replaced), or delete it yourself first"
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

    Held-out documents are kept in memory until the end (they are a small fraction).

    Returns:
        Counts: ``{"train_docs", "train_tokens", "heldout_docs", "heldout_tokens"}``.

    Raises:
        ValueError: bad ``heldout_every``/``heldout_out``, or an output path that exists and
            is not a token folder (checked before any document is read or written).
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
        if Path(heldout_out).expanduser().resolve() == Path(out).expanduser().resolve():
            raise ValueError(
                f"--heldout-out and --out are the same folder ({out}): the held-out documents "
                "would replace the training ones; give --heldout-out a folder of its own"
            )
    held: list[np.ndarray] = []

    def train_docs() -> Iterator[np.ndarray]:
        for i, d in enumerate(docs):
            if heldout_every and i % heldout_every == heldout_every - 1:
                held.append(d)
            else:
                yield d

    tr = write_token_documents(out, train_docs(), source=source)
    stats = {
        "train_docs": len(tr),
        "train_tokens": tr.num_tokens,
        "heldout_docs": 0,
        "heldout_tokens": 0,
    }
    if heldout_every:
        hv = write_token_documents(heldout_out, held, source=source, heldout_every=heldout_every)
        stats.update(heldout_docs=len(hv), heldout_tokens=hv.num_tokens)
    return stats


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(
        prog="python -m fot.data.prepare",
        description="Tokenize text files, folders, .jsonl files or an HF dataset (GPT-2) into a "
        "token folder for `train.py data=tokens data.path=<out>`.",
    )
    ap.add_argument("inputs", nargs="*", help="text files, .jsonl files or folders")
    ap.add_argument(
        "--out",
        required=True,
        help="token folder to write (an existing token folder is replaced; any other "
        "existing path is refused)",
    )
    ap.add_argument("--glob", default="*.txt", help="file pattern inside folders (default *.txt)")
    ap.add_argument("--text-field", default="text", help="text field of .jsonl / HF rows")
    ap.add_argument("--hf", help="HF dataset name or local path (instead of inputs)")
    ap.add_argument("--hf-name", help="HF dataset configuration name")
    ap.add_argument("--split", default="train", help="HF split (default train)")
    ap.add_argument("--streaming", action="store_true", help="stream the HF dataset")
    ap.add_argument("--data-files", nargs="*", help="data_files for the HF loader")
    ap.add_argument("--max-docs", type=int, help="stop after this many documents")
    ap.add_argument("--heldout-every", type=int, default=0, help="hold out every K-th document")
    ap.add_argument("--heldout-out", help="token folder for the held-out documents")
    args = ap.parse_args(argv)
    if bool(args.inputs) == bool(args.hf):
        ap.error("give either input files/folders or --hf (not both, not neither)")
    if args.hf:
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
        texts = iter_texts(args.inputs, glob=args.glob, text_field=args.text_field)
        source = ",".join(args.inputs)
    try:
        stats = prepare(
            tokenize(texts, max_docs=args.max_docs),
            args.out,
            heldout_every=args.heldout_every,
            heldout_out=args.heldout_out,
            source=source,
        )
    except (FileNotFoundError, KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), **stats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
