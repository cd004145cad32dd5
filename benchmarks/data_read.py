"""Reading training data per step: LongCrawl64-shaped zarr rows, and packed documents.

``--reader zarr`` (the default) writes a zarr array of random GPT-2 token ids with
LongCrawl64's row length (65,536 tokens) into a scratch folder (or reads ``--zarr``), then
times training steps of ``--rows`` rows of ``--seq-len`` tokens (one rank's share of a global
batch) read the way ``data=longcrawl64`` reads them: through
:class:`fot.data.zarr_store.ChunkReader` (each chunk fetched and decoded once, kept in a
bounded cache), with the cache off (every step slices the array, which makes zarr fetch and
decode every chunk the step touches), and as training reads: the next step's chunks fetched in
a background thread while the GPU works (a pause of ``--gpu-ms``). The numbers are the mean
host time of a step's read (the training loop waits for it); the ids are Zipf-distributed, so
that they compress about as real tokens do.

``--reader packed`` times the readers that pack documents into sequences (each document with
its BOS, cut into windows of ``T + 1`` tokens) on two corpora of ``--tokens`` random ids: one
long document, and documents of about ``--short-len`` tokens (as web text's). A pass reads the
corpus once, ``--rows`` sequences per step, for every ``--seq-len``; a reader's number is the
fastest of ``--repeats`` passes. The readers: ``data=hf`` (:class:`fot.data.streams.HFSource`
over a ``datasets.Dataset`` of token-id rows, as training reads them; tokenizing text is not
timed) and the same over NumPy arrays in memory (the packing alone), a token folder and a flat
``.npy`` file (both through :func:`fot.data.loaders.open_token_path`), and, as the naive
baseline over the same two kinds of rows, the packer the HF reader was before commit 61ddaac:
for every sequence it concatenates the rest of the document and copies it back, O(document)
per sequence (one pass, stopped after ``--naive-s`` seconds). Every reader must read the same
tokens as ``data=hf`` (checked step by step, by SHA-256).

``--reader trainer`` times what the training loop does on the host for one step's data from a
token folder: :meth:`fot.data.streams.SequenceStream.next_step` (``--rows`` sequences, one
rank's share, cut into micro batches of ``--micro-batch``, ``cu_seqlens`` for varlen) plus the
trainer's token-id screen and label count, for each packing (varlen, causal, padded) and
``--seq-len``, on folders of ``--tokens`` random ids in documents of about each
``--doc-len`` tokens (the median over ``--budget-s`` seconds of steps); then the time to
open each folder, resume at step 100,000 (the position and the data-digest check, which
re-reads the last step) and read the first step there.

    python benchmarks/data_read.py       # LongCrawl64's chunks (2048 x 2048) and two others
    python benchmarks/data_read.py --zarr /data/longcrawl64/train.zarr --steps 200
    python benchmarks/data_read.py --reader packed    # 2M tokens, T = 512 and 2048
    python benchmarks/data_read.py --reader packed --tokens 20000000 --seq-len 4096 --naive-s 10
    python benchmarks/data_read.py --reader trainer   # 50M tokens, T = 16384, 2048 and 256
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fot.data.loaders import open_token_path
from fot.data.streams import EOT_ID, HFSource, SequenceStream, ZarrRowsSource
from fot.data.tokens import write_token_documents
from fot.data.zarr_store import ChunkReader, open_zarr_array

Read = Callable[[int, int], tuple[np.ndarray, np.ndarray]]
"""``(start, count) -> (input_ids, labels)``, each ``[count, T]``: a source's ``read``."""


def _write(path: Path, rows: int, row_len: int, chunk_rows: int, chunk_cols: int) -> None:
    import zarr

    arr = zarr.open_array(  # zarr.create_array is zarr 3's alone (Python 3.10 installs zarr 2)
        str(path), mode="w", shape=(rows, row_len), chunks=(chunk_rows, chunk_cols), dtype="uint16"
    )
    rng = np.random.default_rng(0)
    for r in range(0, rows, 256):  # Zipf-distributed ids: they compress about as text's do
        n = min(256, rows - r)
        arr[r : r + n] = np.minimum(rng.zipf(1.1, (n, row_len)), 50256).astype(np.uint16)


def _time_steps(
    arr: object, seq_len: int, rows: int, steps: int, mode: str, gpu_s: float
) -> tuple[list[float], int]:
    """Host time of each step's read, and a checksum of the tokens read; ``mode``:
    ``uncached``, ``cached`` or ``prefetch`` (the next step's chunks fetched in the background
    during a ``gpu_s`` pause, as in training)."""
    source = ZarrRowsSource(arr, seq_len)
    if mode == "uncached":
        source.reader = ChunkReader(arr, cache_bytes=0)  # every read slices the array
    times, checksum = [], 0
    for step in range(steps):
        t = time.perf_counter()
        _, labels = source.read(step * rows, rows)
        times.append(time.perf_counter() - t)
        checksum += int((labels * np.arange(1, labels.size + 1).reshape(labels.shape)).sum())
        if mode == "prefetch":
            source.prefetch((step + 1) * rows, rows)
            time.sleep(gpu_s)
    return times, checksum


def _chunks(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxCOLUMNS, e.g. 2048x2048") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"chunk sizes must be >= 1, got {text!r}")
    return rows, cols


# --------------------------------------------------------------------------------------------
# packed documents (--reader packed)
# --------------------------------------------------------------------------------------------


def documents(kind: str, tokens: int, short_len: int, seed: int = 0) -> list[np.ndarray]:
    """The documents of one packed corpus, random GPT-2 ids (int64, no BOS).

    Args:
        kind: ``"long"``: one document of ``tokens`` ids; ``"short"``: documents of
            ``short_len // 2 .. short_len * 3 // 2`` ids (uniform), the last one cut so that
            they hold ``tokens`` ids in all.
        tokens: ids in all.
        short_len: the mean length of a short document.
        seed: of the random ids and lengths.

    Returns:
        The documents, in order.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, EOT_ID, tokens, dtype=np.int64)
    if kind == "long":
        return [ids]
    if kind != "short":
        raise ValueError(f"kind must be 'long' or 'short', got {kind!r}")
    shortest = max(1, short_len // 2)
    lengths = rng.integers(shortest, short_len * 3 // 2 + 1, tokens // shortest + 1)  # enough
    ends = np.cumsum(lengths)
    ends = np.append(ends[ends < tokens], tokens)
    return np.split(ids, ends[:-1])


def _naive_reader(dataset: Any, seq_len: int) -> Read:
    """The naive baseline, the packed HF reader before commit 61ddaac: for every sequence it
    concatenates the tokens carried over (the rest of the document) with the next documents
    (BOS first) as far as ``T + 1`` tokens, and copies the rest back: O(document) per
    sequence. Rows are read from ``dataset`` as ``data=hf`` reads them, over and over."""
    rows = itertools.cycle(range(len(dataset)))
    rest = np.zeros(0, dtype=np.int64)

    def read(start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        nonlocal rest
        inputs = np.empty((count, seq_len), dtype=np.int64)
        labels = np.empty((count, seq_len), dtype=np.int64)
        for j in range(count):
            pieces, have = [rest], len(rest)
            while have < seq_len + 1:
                doc = np.concatenate([[EOT_ID], dataset[next(rows)]["input_ids"]])
                pieces.append(doc)
                have += len(doc)
            stream = np.concatenate(pieces)
            inputs[j], labels[j] = stream[:seq_len], stream[1 : seq_len + 1]
            rest = stream[seq_len:].copy()  # the last label is the next sequence's first input
        return inputs, labels

    return read


def _time_pass(read: Read, rows: int, steps: int, budget_s: float) -> tuple[float, list[str]]:
    """Host time of ``steps`` reads of ``rows`` sequences (fewer: those done when the time
    passes ``budget_s``), and the SHA-256 of each step's inputs and labels."""
    total, digests = 0.0, []
    for step in range(steps):
        t = time.perf_counter()
        inputs, labels = read(step * rows, rows)
        total += time.perf_counter() - t
        digests.append(hashlib.sha256(inputs.tobytes() + labels.tobytes()).hexdigest())
        if total > budget_s:
            break
    return total, digests


PACKED_READERS = {
    "data=hf": "datasets.Dataset rows (as training reads them)",
    "naive baseline": "datasets.Dataset rows",
    "data=hf, packing alone": "NumPy arrays in memory",
    "naive baseline, packing alone": "NumPy arrays in memory",
    "token folder": "tokens.bin (memmap)",
    "flat .npy": "the packed stream (memmap)",
}
"""The readers of ``--reader packed`` and where each reads the documents from, in the table's
order; the first is the reference the others must agree with."""


def _time_packed(
    name: str,
    docs: list[np.ndarray],
    seq_lens: Sequence[int],
    rows: int,
    max_steps: int | None,
    naive_s: float,
    repeats: int,
) -> list[dict[str, Any]]:
    """Every reader of :data:`PACKED_READERS` over ``docs`` for each ``T`` of ``seq_lens``:
    the fastest of ``repeats`` passes (the naive baselines: one pass, stopped after
    ``naive_s`` seconds), each of at most ``max_steps`` steps. Raises ``RuntimeError`` where a
    reader reads other tokens than ``data=hf``."""
    import datasets

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        dataset = datasets.Dataset.from_dict({"input_ids": docs})  # rows of Python lists
        arrays = [{"input_ids": d} for d in docs]
        folder = Path(tmp) / "tokens"
        write_token_documents(folder, docs)
        flat = Path(tmp) / "stream.npy"
        stream = np.concatenate([np.concatenate([[EOT_ID], d]) for d in docs])
        np.save(flat, stream.astype(np.uint16))
        for T in seq_lens:
            steps = (len(stream) - 1) // (rows * T)  # one pass, the last label included
            steps = steps if max_steps is None else min(steps, max_steps)
            makers: dict[str, Callable[[], Read]] = {
                "data=hf": lambda T=T: HFSource(lambda: dataset, None, T).read,
                "naive baseline": lambda T=T: _naive_reader(dataset, T),
                "data=hf, packing alone": lambda T=T: HFSource(lambda: arrays, None, T).read,
                "naive baseline, packing alone": lambda T=T: _naive_reader(arrays, T),
                "token folder": lambda T=T: open_token_path(folder, T, "varlen").read,
                "flat .npy": lambda T=T: open_token_path(flat, T, "varlen").read,
            }
            want: list[str] = []
            for reader in PACKED_READERS:
                naive = reader.startswith("naive")
                best = math.inf
                for _ in range(1 if naive else repeats):  # a fresh reader for every pass
                    total, digests = _time_pass(
                        makers[reader](), rows, steps, naive_s if naive else math.inf
                    )
                    want = want or digests
                    bad = next((k for k, (a, b) in enumerate(zip(digests, want)) if a != b), None)
                    if bad is not None:
                        raise RuntimeError(
                            f"{name}, T={T}: {reader} read other tokens than data=hf at step {bad}"
                        )
                    best = min(best, total)
                total = best
                results.append(
                    {
                        "documents": name,
                        "seq_len": T,
                        "reader": reader,
                        "steps": len(digests),
                        "of_steps": steps,
                        "ms_per_step": total / len(digests) * 1e3,
                        "tokens_per_s": len(digests) * rows * T / total,
                        "digests": digests,
                    }
                )
    return results


def _packed_table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown rows, one per corpus, ``T`` and reader; ``data=hf`` against the naive baseline
    that reads the same rows."""
    lines = [
        "| documents | T | reader | documents from | steps | ms per step | M tokens/s | "
        "vs naive baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    speed = {(r["documents"], r["seq_len"], r["reader"]): r["tokens_per_s"] for r in results}
    for r in results:
        steps = str(r["steps"])
        if r["steps"] < r["of_steps"]:
            steps = f"first {r['steps']} of {r['of_steps']}"
        ratio = ""
        if r["reader"].startswith("data=hf"):
            naive = r["reader"].replace("data=hf", "naive baseline")
            ratio = f"{r['tokens_per_s'] / speed[r['documents'], r['seq_len'], naive]:.1f}x"
        lines.append(
            f"| {r['documents']} | {r['seq_len']} | {r['reader']} | "
            f"{PACKED_READERS[r['reader']]} | {steps} | {r['ms_per_step']:.2f} | "
            f"{r['tokens_per_s'] / 1e6:.2f} | {ratio} |"
        )
    return lines


# --------------------------------------------------------------------------------------------
# a training step's data from a token folder (--reader trainer)
# --------------------------------------------------------------------------------------------

PACKINGS = ("varlen", "causal", "padded")


def _time_step_data(stream: SequenceStream, budget_s: float) -> float:
    """Median host seconds of one step's data as the trainer takes it: ``next_step`` and the
    token-id screen and label count it runs on every step's batches."""
    from fot.training.trainer import _screen_token_ids

    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or len(times) < 3:
        t = time.perf_counter()
        batches, _ = _screen_token_ids(stream.next_step(), EOT_ID + 1, what="", world_size=1)
        for b in batches:
            b.num_label_tokens()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _steps_table(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """``--reader trainer``: print and return one row per folder, T and packing (``ms_per_step``,
    ``tokens_per_s``), then the open / resume / first-step times per folder."""
    print(
        "| documents | T | micro batch | sequences per step | packing | ms per step | M tokens/s |"
    )
    print("|---|---|---|---|---|---|---|")
    results, folders = [], []
    for doc_len in args.doc_len:
        docs = documents("short", args.tokens, doc_len)
        folder = tmp / f"docs{doc_len}"
        write_token_documents(folder, docs)
        folders.append((f"{len(docs):,} of ~{doc_len:,} tokens", folder))
        for T in args.seq_len:
            for packing in PACKINGS:
                stream = SequenceStream(
                    open_token_path(folder, T, packing),
                    global_batch_size=args.rows,
                    micro_batch_size=args.micro_batch,
                )
                stream.next_step()  # (the first read opens the memmaps)
                s = _time_step_data(stream, args.budget_s)
                rate = args.rows * T / s
                results.append({"doc_len": doc_len, "T": T, "packing": packing,
                                "ms_per_step": s * 1e3, "tokens_per_s": rate})  # fmt: skip
                print(f"| {folders[-1][0]} | {T} | {args.micro_batch} | {args.rows} | {packing} "
                      f"| {s * 1e3:.2f} | {rate / 1e6:.1f} |")  # fmt: skip
    T = max(args.seq_len)
    print("\n| documents | open (ms) | resume at step 100,000 (ms) | first step there (ms) |")
    print("|---|---|---|---|")
    for name, folder in folders:
        t0 = time.perf_counter()
        stream = SequenceStream(open_token_path(folder, T, "varlen"),
                                global_batch_size=args.rows, micro_batch_size=args.micro_batch)  # fmt: skip
        t1 = time.perf_counter()
        stream.load_state_dict({"position": 100_000 * args.rows, "source": {}})
        stream.last_step_digest()
        t2 = time.perf_counter()
        stream.next_step()
        t3 = time.perf_counter()
        print(f"| {name} | {(t1 - t0) * 1e3:.0f} | {(t2 - t1) * 1e3:.0f} | {(t3 - t2) * 1e3:.0f} |")
    return results


ZARR_ONLY = ("zarr", "array_rows", "row_len", "chunks", "gpu_ms")
PACKED_ONLY = ("short_len", "naive_s", "repeats")
TRAINER_ONLY = ("doc_len", "micro_batch", "budget_s")
ONLY = {"zarr": ZARR_ONLY, "packed": PACKED_ONLY, "trainer": TRAINER_ONLY}


def main(argv: list[str] | None = None) -> list[dict[str, Any]] | None:
    """Time the reads; print a markdown table.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``--reader packed``: one dict per corpus (``corpus``: ``"long"`` or ``"short"``, as
        :func:`documents` makes it), ``T`` and reader (``ms_per_step``, ``tokens_per_s``,
        ``steps`` timed of ``of_steps``, and ``digests``: the SHA-256 of each step's inputs and
        labels); ``--reader trainer``: one dict per folder, T and packing (``doc_len``, ``T``,
        ``packing``, ``ms_per_step``, ``tokens_per_s``); ``--reader zarr``: ``None`` (the table
        alone).
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--reader",
        choices=("zarr", "packed", "trainer"),
        default="zarr",
        help="zarr: LongCrawl64-shaped rows; packed: documents packed into sequences (data=hf, "
        "token folders, flat .npy) against the naive baseline; trainer: a training step's data "
        "from a token folder, as the trainer takes it",
    )
    p.add_argument("--zarr", help="an existing 2-D zarr token array (default: write some)")
    p.add_argument("--array-rows", type=int, default=2048, help="rows of the written arrays")
    p.add_argument("--row-len", type=int, default=65536, help="tokens per written row")
    p.add_argument(
        "--chunks",
        type=_chunks,
        nargs="+",
        default=[(2048, 2048), (1, 65536), (128, 65536)],
        help="chunk shapes of the written arrays, ROWSxCOLUMNS (LongCrawl64's: 2048x2048)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        nargs="+",
        help="T (default: zarr 16384; packed 512 2048; trainer 16384 2048 256; each timed)",
    )
    p.add_argument("--rows", type=int, default=32, help="sequences per step (one rank's share)")
    p.add_argument(
        "--steps",
        type=int,
        help="steps per way (default: zarr 24; packed: a pass over the corpus, at most this many)",
    )
    p.add_argument("--gpu-ms", type=float, default=100.0, help="GPU time per step (a pause)")
    p.add_argument(
        "--tokens",
        type=int,
        help="packed, trainer: ids in each corpus (no BOS; default: packed 2,000,000, "
        "trainer 50,000,000)",
    )
    p.add_argument(
        "--short-len", type=int, default=1000, help="packed: mean length of a short document"
    )
    p.add_argument(
        "--naive-s",
        type=float,
        default=60.0,
        help="packed: the naive baseline stops after the step that passes this many seconds",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="packed: passes per reader, the fastest kept (the naive baselines make one)",
    )
    p.add_argument(
        "--doc-len",
        type=int,
        nargs="+",
        default=[50, 1000],
        help="trainer: the mean document length of each token folder timed",
    )
    p.add_argument("--micro-batch", type=int, default=1, help="trainer: sequences per micro batch")
    p.add_argument(
        "--budget-s", type=float, default=2.0, help="trainer: seconds of steps timed per row"
    )
    args = p.parse_args(argv)
    readers_of = {name: [r] for r, names in ONLY.items() for name in names}
    readers_of["tokens"] = ["packed", "trainer"]
    readers_of["steps"] = ["zarr", "packed"]
    for name, readers in readers_of.items():
        if args.reader not in readers and getattr(args, name) != p.get_default(name):
            flag = "--" + name.replace("_", "-")
            which = " or ".join(f"--reader {r}" for r in readers)
            default = " (the default)" if readers == ["zarr"] else ""
            p.error(
                f"{flag} applies to {which}{default} only; drop it, or pass --reader {readers[0]}"
            )
    if args.seq_len is None:
        args.seq_len = {"zarr": [16384], "packed": [512, 2048], "trainer": [16384, 2048, 256]}[
            args.reader
        ]
    if args.tokens is None:
        args.tokens = 50_000_000 if args.reader == "trainer" else 2_000_000
    names = ("array_rows", "row_len", "rows", "steps", "tokens", "short_len", "repeats")
    for name in (*names, "micro_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if min(args.seq_len) < 1:
        p.error(f"--seq-len must be >= 1, got {min(args.seq_len)}")
    if args.naive_s <= 0:
        p.error(f"--naive-s must be > 0, got {args.naive_s}")
    if not args.gpu_ms >= 0:  # NaN too
        p.error(f"--gpu-ms must be >= 0 (0: no GPU time between steps), got {args.gpu_ms}")
    if args.reader == "trainer":
        if min(args.doc_len) < 1 or args.budget_s <= 0:
            p.error(
                f"--doc-len must be >= 1 and --budget-s > 0, got {args.doc_len}, {args.budget_s}"
            )
        if args.rows % args.micro_batch:
            p.error(f"--rows {args.rows} is not a multiple of --micro-batch {args.micro_batch}")
        if args.tokens < args.rows * (max(args.seq_len) + 1):
            p.error(
                f"--tokens {args.tokens} is less than one step of --rows {args.rows} x "
                f"--seq-len {max(args.seq_len)}; give more --tokens or fewer --rows"
            )
        with tempfile.TemporaryDirectory() as tmp:
            return _steps_table(args, Path(tmp))
    if args.reader == "packed":
        T = max(args.seq_len)
        if args.tokens < args.rows * T:  # one pass over the stream must hold a step
            p.error(
                f"--tokens {args.tokens} is less than one step of --rows {args.rows} x "
                f"--seq-len {T}; give more --tokens or fewer --rows"
            )
        results = []
        for name, kind in (
            (f"1 of {args.tokens:,} tokens", "long"),
            (f"~{args.short_len:,} tokens each", "short"),
        ):
            docs = documents(kind, args.tokens, args.short_len)
            if kind == "short":
                name = f"{len(docs):,} of " + name
            part = _time_packed(
                name, docs, args.seq_len, args.rows, args.steps, args.naive_s, args.repeats
            )
            results += [{**r, "corpus": kind} for r in part]
        print("\n".join(_packed_table(results)))
        return results
    if len(args.seq_len) > 1:
        p.error("--reader zarr times one --seq-len at a time; run it once per length")
    args.seq_len = args.seq_len[0]
    args.steps = 24 if args.steps is None else args.steps
    if args.seq_len > args.row_len:
        p.error(f"--seq-len {args.seq_len} is longer than a row (--row-len {args.row_len})")
    given = None
    if args.zarr:  # before the table's header: a bad path is one line, not a traceback
        try:
            given = open_zarr_array(args.zarr)
        except (OSError, ValueError, ImportError) as err:  # ImportError: gcsfs, s3fs missing
            p.error(f"--zarr: {err}")

    print(
        "| array | chunks | uncached: ms per step | cached | cached, fetched ahead "
        f"(during {args.gpu_ms} ms of GPU work) |"
    )
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        arrays = []
        if given is not None:
            arrays.append(given)
        else:
            for cr, cc in args.chunks:
                path = Path(tmp) / f"c{cr}x{cc}.zarr"
                _write(path, args.array_rows, args.row_len, cr, cc)
                arrays.append(open_zarr_array(path))
        for arr in arrays:
            steps = max(1, min(args.steps, arr.shape[0] // args.rows - 1))
            got, sums = [], set()
            for mode in ("uncached", "cached", "prefetch"):
                times, checksum = _time_steps(
                    arr, args.seq_len, args.rows, steps, mode, args.gpu_ms / 1e3
                )
                got.append(statistics.mean(times) * 1e3)
                sums.add(checksum)
            if len(sums) != 1:  # the three ways must read the same tokens
                raise RuntimeError(f"the reads of {arr} differ between the modes: {sums}")
            print(
                f"| {tuple(arr.shape)} | {tuple(arr.chunks)} | "
                + " | ".join(f"{t:.1f}" for t in got)
                + " |"
            )


if __name__ == "__main__":
    main()
