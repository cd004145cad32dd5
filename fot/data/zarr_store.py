"""2-D zarr token arrays (LongCrawl64) on a local disk or behind a URL, read in whole chunks.

``data.path`` may be a folder or a URL that fsspec knows: ``gs://<bucket>/longcrawl64``
streams a copy of LongCrawl64 from a Google Cloud bucket (``pip install gcsfs``; its own bucket,
``gs://longcrawl64``, is reported gone), ``s3://...`` needs ``s3fs``, ``https://...`` needs
``aiohttp``, ``hf://datasets/<repo>`` works as it is. ``data.storage_options`` goes to the
filesystem (credentials, ``{token: anon}`` for gcsfs, HTTP headers).

zarr reads whole chunks, so a step that reads 32 rows of one column would fetch (and decode)
every chunk it touches again at the next step, however few of its rows it used. A
:class:`ChunkReader` keeps the chunks it read (a bounded LRU cache), fetches the chunks of the
next step in a background thread while the GPU runs the current one (:meth:`prefetch`), and,
for data behind a URL, retries a failed read with a growing wait before giving up with a
message that says how to resume.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import re
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import numpy as np

from fot.errors import MissingPackageError

logger = logging.getLogger("fot.data")

ZARR_METADATA = ("zarr.json", ".zarray", ".zgroup")
"""Files that mark a zarr v3 node, a v2 array and a v2 group."""

CACHE_BYTES = 256 << 20
"""Default size of a :class:`ChunkReader`'s cache, and the least :func:`cache_bytes_for` gives."""
MAX_AUTO_CACHE_BYTES = 4 << 30
"""The most :func:`cache_bytes_for` gives (a larger cache is asked for explicitly)."""

_FILESYSTEM_PACKAGES = {
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "s3": "s3fs",
    "az": "adlfs",
    "abfs": "adlfs",
    "http": "aiohttp",
    "https": "aiohttp",
}


def is_url(path: str | Path) -> bool:
    """``True`` for an fsspec URL (``gs://bucket/x``, ``https://host/x``), ``False`` for a path."""
    return "://" in str(path)


def shown_path(path: str | Path) -> str:
    """``path`` for an error message: a relative path also gets the absolute one it named
    (``data/x (= /home/me/run/data/x)``), since the working folder is easy to mistake."""
    if is_url(path) or Path(path).expanduser().is_absolute():
        return str(path)
    return f"{path} (= {Path(path).expanduser().absolute()})"


def join(root: str | Path, name: str) -> str:
    """``root/name`` for a local folder or a URL."""
    if is_url(root):
        return str(root).rstrip("/") + "/" + name
    return str(Path(root).expanduser() / name)


def _filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """``(fsspec filesystem, path)`` of ``url``, with the package to install named if missing."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as err:
        protocol = url.split("://", 1)[0]
        package = _FILESYSTEM_PACKAGES.get(protocol, f"the fsspec filesystem for {protocol}://")
        raise MissingPackageError(
            f"reading {url} needs {package}: `pip install {package}` ({err})"
        ) from None
    except ValueError as err:  # unknown protocol
        raise ValueError(
            f"{url} is not a URL fsspec can read ({err}); use a local path, gs://, s3:// or "
            "https://"
        ) from None


def zarr_exists(path: str | Path, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` (folder or URL) holds zarr metadata (an array or a group)."""
    if not is_url(path):
        p = Path(path).expanduser()
        return p.is_dir() and any((p / m).exists() for m in ZARR_METADATA)
    fs, root = _filesystem(str(path), storage_options)
    root = root.rstrip("/")
    try:
        return any(fs.exists(f"{root}/{m}") for m in ZARR_METADATA)
    except (OSError, ValueError) as err:
        raise OSError(
            f"could not reach {path} ({type(err).__name__}: {err}); check the URL, the network "
            "and the credentials (data.storage_options)"
        ) from None


def _holds(path: str | Path, name: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether the folder or URL ``path`` holds the file ``name``."""
    if not is_url(path):
        return (Path(path).expanduser() / name).exists()
    fs, root = _filesystem(str(path), storage_options)
    return bool(fs.exists(f"{root.rstrip('/')}/{name}"))


def chunk_key_encoder(arr: Any) -> Callable[[tuple[int, ...]], str] | None:
    """``chunk coordinates -> the chunk's file name`` relative to the array's folder (``"0.1"``,
    ``"c/0/1"``), or ``None`` for an array that is not zarr's (numpy).

    zarr 3 names a chunk by its array's metadata; zarr 2 (what Python 3.10 installs) by the
    array's ``_chunk_key``.
    """
    encode = getattr(getattr(arr, "metadata", None), "encode_chunk_key", None)
    return encode if encode is not None else getattr(arr, "_chunk_key", None)


def chunk_checker(
    arr: Any, url: str, storage_options: dict[str, Any] | None = None
) -> Callable[[tuple[int, int]], bool] | None:
    """``(chunk row, chunk column) -> bool``: whether the chunk's file is stored at ``url``,
    for :class:`ChunkReader` (``None`` for a sharded array, whose chunks live inside shards).

    Only "not found" answers ``False``; any other failure (HTTP 503, a dropped connection)
    raises, for the reader to retry. fsspec's ``exists`` answers ``False`` to every failure,
    and its HTTP ``info`` raises ``FileNotFoundError`` for every failure: HTTP asks
    ``exists(strict=True)``, the other filesystems ``info``.
    """
    if getattr(arr, "shards", None) is not None:
        return None
    encode = chunk_key_encoder(arr)
    if encode is None:
        return None
    fs, root = _filesystem(url, storage_options)
    root = root.rstrip("/")
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    http = bool({"http", "https"} & set(protocols))

    def stored(coords: tuple[int, int]) -> bool:
        path = f"{root}/{encode(coords)}"
        if http:
            return bool(fs.exists(path, strict=True))
        try:
            fs.info(path)
        except FileNotFoundError:
            return False
        return True

    return stored


def open_zarr_array(path: str | Path, *, storage_options: dict[str, Any] | None = None) -> Any:
    """Open a 2-D zarr token array read-only, from a local path or a URL.

    Args:
        path: a folder (``.../train.zarr``) or an fsspec URL (``gs://<bucket>/train.zarr``).
        storage_options: options of the URL's filesystem (credentials, headers).

    Returns:
        The zarr array (``[rows, row_len]`` of integer token ids, not checked here).

    Raises:
        FileNotFoundError: nothing at ``path``, with where LongCrawl64 is found.
        ValueError: not a zarr array (a group, or unreadable metadata).
        MissingPackageError: a URL whose filesystem package (gcsfs, s3fs) is not installed.
    """
    import zarr

    missing = FileNotFoundError(
        f"zarr array {shown_path(path)} does not exist. LongCrawl64 "
        "(https://manifestai.com/articles/longcrawl64): put train.zarr and heldout.zarr "
        "into one folder, on a disk or behind a URL (gs://, s3://, https://), and set "
        "data.path=<that folder>; or turn your own text into tokens with "
        "`python -m fot.data.prepare --help`."
    )
    url = is_url(path)
    if url:
        _filesystem(str(path), storage_options)  # the package to install, named
    else:
        path = Path(path).expanduser()
        if not path.exists():
            raise missing
    try:
        if url:
            arr = zarr.open(str(path), mode="r", storage_options=storage_options or {})
        else:
            arr = zarr.open(str(path), mode="r")
    except Exception as err:  # zarr's errors differ by version and store; all mean "not zarr"
        # Behind a URL, whether anything is there is asked only when the open fails: asked
        # first, it would cost a request per metadata file name on every successful open.
        if url and not zarr_exists(path, storage_options):
            raise missing from None
        if int(zarr.__version__.split(".")[0]) < 3 and _holds(path, "zarr.json", storage_options):
            raise ValueError(
                f"{path} is a zarr format 3 array (zarr.json), which zarr {zarr.__version__} "
                "cannot read: install zarr>=3 (`pip install 'zarr>=3'`, on Python >= 3.11), or "
                "write the array again in zarr format 2 with zarr 3 "
                "(zarr.create_array(..., zarr_format=2))"
            ) from None
        raise ValueError(
            f"{path} is not a readable zarr array ({type(err).__name__}: {err}); point to a 2-D "
            "zarr token array (such as LongCrawl64's train.zarr), or to a token folder made by "
            "`python -m fot.data.prepare`"
        ) from None
    if not hasattr(arr, "shape"):
        raise ValueError(f"{path} is a zarr group, not an array; point to the array itself")
    if not url:
        _warn_if_chunks_are_missing(arr, path)
    return arr


def _warn_if_chunks_are_missing(arr: Any, path: str | Path) -> None:
    """Warn when chunks of a local array are absent: zarr reads them as the fill value
    (token 0) without an error, and an interrupted download leaves them out. (Not checked
    behind a URL, where counting the chunks means listing the whole bucket.)"""
    if int(os.environ.get("RANK", "0")) != 0 or not arr.shape:  # every rank opens it
        return
    grid = getattr(arr, "shards", None) or arr.chunks  # a sharded array's files are its shards
    total = math.prod(-(-int(s) // int(c)) for s, c in zip(arr.shape, grid))
    stored = _stored_chunks(Path(path), len(arr.shape))
    if stored < total:
        logger.warning(
            "%s holds %d of its %d chunks: the missing ones read as %s in every row "
            "they cover. An interrupted download leaves chunks out: finish it (e.g. `gsutil -m "
            "rsync -r gs://<bucket>/%s %s`), or stream a complete copy (data.path=<its URL>)",
            path,
            stored,
            total,
            f"token id {arr.fill_value}"
            if arr.fill_value is not None
            else "what zarr reads where an array has no fill_value (0 in zarr 3, whatever "
            "memory held in zarr 2)",
            Path(path).name,
            path,
        )


def _stored_chunks(path: Path, ndim: int) -> int:
    """Chunk (or shard) files in the local array folder ``path``: names of ``ndim`` integers
    joined by ``.`` or ``/``, after ``c/`` or ``c.`` in zarr v3 (``3.0``, ``3/0``, ``c/3/0``).

    One pass over the folder: zarr's ``nchunks_initialized`` compares every chunk key with a
    list of every stored key (minutes for LongCrawl64's 103,296 chunks).
    """
    key = re.compile(rf"(?:c[./])?\d+(?:[./]\d+){{{ndim - 1}}}")
    n = 0
    for folder, _, files in os.walk(path):
        rel = os.path.relpath(folder, path)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        n += sum(1 for f in files if key.fullmatch(prefix + f))
    return n


class _Worker:
    """One daemon thread that runs queued jobs in order (a stuck network read cannot hold up
    the interpreter's exit, as a ``ThreadPoolExecutor`` worker would)."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue[tuple[Future, Callable[[], Any]] | None] = SimpleQueue()
        threading.Thread(target=self._run, name="fot-zarr-prefetch", daemon=True).start()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            future, job = item
            try:
                future.set_result(job())
            except BaseException as err:  # handed to whoever waits on the future
                future.set_exception(err)
            # a job holds its reader (and the reader its cache): not kept while waiting
            del item, future, job

    def stop(self) -> None:
        """End the thread after the jobs queued before."""
        self._jobs.put(None)

    def submit(self, future: Future, job: Callable[[], Any]) -> None:
        """Run ``job`` after the jobs before it; its result or error goes to ``future``."""
        self._jobs.put((future, job))


Key = tuple[int, int, int]
"""A cached piece: (chunk row index, first column, end column) of the column window."""


_CODEC_ERRORS = (RuntimeError, ValueError, EOFError, zlib.error, gzip.BadGzipFile)
"""What zarr's codecs raise for a chunk file they cannot decode (blosc and zstd: RuntimeError,
a short or empty file: ValueError or EOFError, zlib: zlib.error, gzip: gzip.BadGzipFile, an
OSError: no other OSError, such as a permission error, is taken for a damaged file)."""


class ChunkReader:
    """Reads ``array[r0:r1, c0:c1]`` in whole chunks, keeping them in a bounded LRU cache.

    A *piece* is one row of chunks across the chunk columns that cover the columns asked for.
    Reads that touch missing pieces fetch each run of consecutive missing pieces in one call
    (zarr fetches its chunks concurrently). Arrays without ``chunks`` (numpy) are sliced
    directly.

    Args:
        array: ``[R, L]`` zarr array (or numpy array).
        cache_bytes: most bytes of pieces kept (pieces that one read needs are always kept).
            A piece larger than a quarter of it is not cached: such reads go to the array.
        retries: extra attempts of a failed read (for data behind a URL), waiting
            ``retry_wait_s * 2**attempt`` seconds between them; 0 lets errors through as they are.
        retry_wait_s: the first wait.
        name: the array's path or URL, for messages.
        chunk_exists: ``(chunk row, chunk column) -> bool``, asked about a chunk that reads as
            nothing but the fill value (about every chunk, once, where the array has none):
            ``False`` (not stored) stops the read with an error, where zarr gives the fill
            value without a word (:func:`chunk_checker`).
    """

    def __init__(
        self,
        array: Any,
        *,
        cache_bytes: int = CACHE_BYTES,
        retries: int = 0,
        retry_wait_s: float = 1.0,
        name: str = "the zarr array",
        chunk_exists: Callable[[tuple[int, int]], bool] | None = None,
    ) -> None:
        self.array = array
        self.rows, self.cols = (int(s) for s in array.shape)
        chunks = getattr(array, "chunks", None)
        self.chunk_rows = int(chunks[0]) if chunks else 0
        self.chunk_cols = int(chunks[1]) if chunks else 0
        self.itemsize = np.dtype(array.dtype).itemsize
        self.cache_bytes = int(cache_bytes)
        self.retries = int(retries)
        self.retry_wait_s = float(retry_wait_s)
        self.name = name
        self.chunk_exists = chunk_exists if self.chunk_rows else None
        self.fill_value = getattr(array, "fill_value", None)
        self._pieces: OrderedDict[Key, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._pending: dict[Key, Future] = {}
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._stored: set[tuple[int, int]] = set()  # chunks looked up (no fill value)

    # ---- reading -----------------------------------------------------------------------

    def _refuse_missing_chunks(self, block: np.ndarray, r0: int, c0: int) -> None:
        """Raise where a chunk of ``block`` (at ``r0, c0``) is all fill value and not stored.

        An array without a fill value (``fill_value: null``) gives no sign of a missing chunk
        (zarr 3 reads zeros, zarr 2 whatever memory held): each of its chunks is looked up
        once, the first time it is read.
        """
        cr, cc, fill = self.chunk_rows, self.chunk_cols, self.fill_value
        rows, cols = block.shape
        for i in range(r0 // cr, (r0 + rows - 1) // cr + 1):
            rs = slice(max(i * cr, r0) - r0, min((i + 1) * cr, r0 + rows) - r0)
            for j in range(c0 // cc, (c0 + cols - 1) // cc + 1):
                if fill is None:
                    if (i, j) in self._stored:
                        continue
                else:
                    cell = block[rs, max(j * cc, c0) - c0 : min((j + 1) * cc, c0 + cols) - c0]
                    if cell.flat[0] != fill or not (cell == fill).all():
                        continue
                if not self.chunk_exists((i, j)):  # one line from train.py and fot.eval
                    reads_as = "zeros or arbitrary ids" if fill is None else f"token id {fill}"
                    raise FileNotFoundError(
                        f"chunk ({i}, {j}) of {self.name} (rows {i * cr}..{(i + 1) * cr - 1}, "
                        f"columns {j * cc}..{(j + 1) * cc - 1}) is not there: zarr would read "
                        f"it as {reads_as}. The copy at this URL is incomplete; train on a "
                        "complete copy (check the chunk count of the original)"
                    )
                if fill is None:
                    self._stored.add((i, j))

    def _read_checked(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        block = np.asarray(self.array[r0:r1, c0:c1])
        if self.chunk_exists is not None:
            self._refuse_missing_chunks(block, r0, c0)
        return block

    def _damaged(self, err: BaseException, r0: int, r1: int, c0: int, c1: int) -> ValueError:
        """The error for a read of a local array that zarr could not decode: it names the
        chunk files that hold ``[r0:r1, c0:c1]`` (zarr's own message names none)."""
        where = ""
        encode = chunk_key_encoder(self.array)
        if self.chunk_rows and encode is not None and getattr(self.array, "shards", None) is None:
            keys = [
                encode((i, j))
                for i in range(r0 // self.chunk_rows, (r1 - 1) // self.chunk_rows + 1)
                for j in range(c0 // self.chunk_cols, (c1 - 1) // self.chunk_cols + 1)
            ]
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            where = f" (its chunk file{'s' if len(keys) > 1 else ''} {shown})"
        return ValueError(
            f"could not decode rows {r0}..{r1 - 1}, columns {c0}..{c1 - 1} of {self.name}"
            f"{where}: {type(err).__name__}: {err}. A chunk file there is damaged, as when a "
            "copy is cut short: copy the array again from the original"
        )

    def _get(self, r0: int, r1: int, c0: int, c1: int, *, retries: int | None = None) -> np.ndarray:
        """``array[r0:r1, c0:c1]`` as numpy, retried ``retries`` times (default: the reader's),
        with its missing chunks refused (a failed lookup is retried with the read)."""
        n = self.retries if retries is None else retries
        attempt = 0
        while True:
            if n == 0:
                try:
                    return self._read_checked(r0, r1, c0, c1)
                except FileNotFoundError:
                    raise
                except _CODEC_ERRORS as err:  # a codec's, on a bad file
                    raise self._damaged(err, r0, r1, c0, c1) from err
            try:
                return self._read_checked(r0, r1, c0, c1)
            except FileNotFoundError:  # a chunk that is not stored: no retry brings it
                raise
            except Exception as err:  # network errors come in many types (aiohttp, gcsfs, OSError)
                if attempt == n:  # a ConnectionError prints as one line (fot.errors)
                    raise ConnectionError(
                        f"could not read rows {r0}..{r1 - 1}, columns {c0}..{c1 - 1} of "
                        f"{self.name} after {n + 1} attempts ({type(err).__name__}: {err}). "
                        "Check the network and the credentials (data.storage_options); the "
                        "run's checkpoints are kept: restart the same command (resume=auto) to "
                        "go on from the last one"
                    ) from err
                wait = self.retry_wait_s * 2**attempt
                logger.warning(
                    "reading rows %d..%d of %s failed (%s: %s); attempt %d of %d in %.1f s",
                    r0,
                    r1 - 1,
                    self.name,
                    type(err).__name__,
                    err,
                    attempt + 2,
                    n + 1,
                    wait,
                )
                time.sleep(wait)
                attempt += 1

    def piece_bytes(self, c0: int, c1: int) -> int:
        """Bytes of one piece of the columns ``[c0, c1)`` (0 for an array without chunks)."""
        if not self.chunk_rows:
            return 0
        cc = self.chunk_cols
        return self.chunk_rows * (min(self.cols, -(-c1 // cc) * cc) - c0 // cc * cc) * self.itemsize

    def _window(self, c0: int, c1: int) -> tuple[int, int] | None:
        """The chunk-aligned column window of ``[c0, c1)``, or ``None`` when not cached."""
        if not self.chunk_rows or self.piece_bytes(c0, c1) * 4 > self.cache_bytes:
            return None
        cc = self.chunk_cols
        return c0 // cc * cc, min(self.cols, -(-c1 // cc) * cc)

    def _fetch_pieces(self, k0: int, k1: int, a: int, b: int, *, retries: int | None) -> None:
        """Read chunk rows ``k0 .. k1-1`` of window ``[a, b)`` in one call and cache them."""
        cr = self.chunk_rows
        block = self._get(k0 * cr, min(self.rows, k1 * cr), a, b, retries=retries)
        with self._lock:
            for k in range(k0, k1):
                key = (k, a, b)
                if key not in self._pieces:
                    piece = block[(k - k0) * cr : (k - k0 + 1) * cr]
                    self._pieces[key] = piece
                    self._bytes += piece.nbytes

    def _evict(self, keep: set[Key]) -> None:
        with self._lock:
            for key in list(self._pieces):
                if self._bytes <= self.cache_bytes:
                    break
                if key in keep or key in self._pending:
                    continue
                self._bytes -= self._pieces.pop(key).nbytes

    def read(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """``array[r0:r1, c0:c1]`` (``r0 < r1``, ``c0 < c1``) as a numpy array.

        Waits for a prefetch of the same chunks; where that failed, reads them itself (with
        the retries).
        """
        window = self._window(c0, c1)
        if window is None:
            return self._get(r0, r1, c0, c1)
        a, b = window
        cr = self.chunk_rows
        k0, k1 = r0 // cr, (r1 - 1) // cr + 1
        keys = [(k, a, b) for k in range(k0, k1)]
        for key in keys:
            future = self._pending.get(key)
            if future is not None:
                future.exception()  # waits; a failed prefetch is read again below
        missing = [k for k, key in zip(range(k0, k1), keys) if key not in self._pieces]
        for lo, hi in consecutive_runs(missing):
            self._fetch_pieces(lo, hi, a, b, retries=None)
        with self._lock:
            pieces = []
            for key in keys:
                self._pieces.move_to_end(key)
                pieces.append(self._pieces[key])
        self._evict(set(keys))
        block = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return block[r0 - k0 * cr : r1 - k0 * cr, c0 - a : c1 - a]

    def prefetch(self, r0: int, r1: int, c0: int, c1: int) -> None:
        """Start fetching the chunks of ``array[r0:r1, c0:c1]`` in the background.

        One attempt each: a failed prefetch is left to :meth:`read`, which retries.
        """
        window = self._window(c0, c1)
        if window is None:
            return
        a, b = window
        cr = self.chunk_rows
        with self._lock:
            missing = [
                k
                for k in range(r0 // cr, (r1 - 1) // cr + 1)
                if (k, a, b) not in self._pieces and (k, a, b) not in self._pending
            ]
        if not missing:
            return
        if self._worker is None:
            self._worker = _Worker()
            weakref.finalize(self, self._worker.stop)  # the thread ends with the reader
        for lo, hi in consecutive_runs(missing):
            keys = [(k, a, b) for k in range(lo, hi)]
            future: Future = Future()
            with self._lock:  # registered first: a read of these chunks waits for the fetch
                for key in keys:
                    self._pending[key] = future

            def job(
                lo: int = lo, hi: int = hi, keys: list[Key] = keys, future: Future = future
            ) -> None:
                try:
                    self._fetch_pieces(lo, hi, a, b, retries=0)
                finally:
                    with self._lock:
                        for key in keys:
                            if self._pending.get(key) is future:
                                del self._pending[key]

            self._worker.submit(future, job)


def cache_bytes_for(reader: ChunkReader, spans: Sequence[tuple[int, int]]) -> int:
    """A cache size that keeps four pieces of the widest column span ``(c0, c1)`` read, so that
    reads are cached (:meth:`ChunkReader.read`): at least :data:`CACHE_BYTES`, at most
    :data:`MAX_AUTO_CACHE_BYTES`."""
    widest = max((reader.piece_bytes(c0, c1) for c0, c1 in spans), default=0)
    return min(max(CACHE_BYTES, 4 * widest), MAX_AUTO_CACHE_BYTES)


def consecutive_runs(ks: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted integers as ``[lo, hi)`` pairs: ``[1, 2, 5]`` -> ``[(1, 3), (5, 6)]``."""
    out: list[tuple[int, int]] = []
    for k in ks:
        if out and out[-1][1] == k:
            out[-1] = (out[-1][0], k + 1)
        else:
            out.append((k, k + 1))
    return out
