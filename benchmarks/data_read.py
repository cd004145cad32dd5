"""Reading LongCrawl64-shaped zarr rows: whole chunks through the cache against plain slicing.

Writes a zarr array of random GPT-2 token ids with LongCrawl64's row length (65,536 tokens)
into a scratch folder (or reads ``--zarr``), then times training steps of ``--rows`` rows of
``--seq-len`` tokens (one rank's share of a global batch) read the way ``data=longcrawl64``
reads them: through :class:`fot.data.zarr_store.ChunkReader` (each chunk fetched and decoded
once, kept in a bounded cache), with the cache off (every step slices the array, which makes
zarr fetch and decode every chunk the step touches), and as training reads: the next step's
chunks fetched in a background thread while the GPU works (a pause of ``--gpu-ms``). The
numbers are the mean host time of a step's read (the training loop waits for it); the ids are
Zipf-distributed, so that they compress about as real tokens do.

    python benchmarks/data_read.py       # LongCrawl64's chunks (2048 x 2048) and two others
    python benchmarks/data_read.py --zarr /data/longcrawl64/train.zarr --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from fot.data.streams import ZarrRowsSource
from fot.data.zarr_store import ChunkReader, open_zarr_array


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


def main(argv: list[str] | None = None) -> None:
    """Time the reads; print a markdown table (one row per array)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--rows", type=int, default=32, help="rows per step (one rank's share)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--gpu-ms", type=float, default=100.0, help="GPU time per step (a pause)")
    args = p.parse_args(argv)
    for name in ("array_rows", "row_len", "seq_len", "rows", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len > args.row_len:
        p.error(f"--seq-len {args.seq_len} is longer than a row (--row-len {args.row_len})")

    print(
        "| array | chunks | uncached: ms per step | cached | cached, fetched ahead "
        f"(during {args.gpu_ms} ms of GPU work) |"
    )
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        arrays = []
        if args.zarr:
            arrays.append(open_zarr_array(args.zarr))
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
