"""Build the training and held-out sequence sources from a ``data`` config."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from fot.data.streams import (
    EOT_ID,
    PACKINGS,
    HFSource,
    PackedSource,
    PaddedSource,
    ZarrRowsSource,
)
from fot.data.zarr_store import (
    chunk_checker,
    is_url,
    join,
    open_zarr_array,
    shown_path,
    zarr_exists,
)
from fot.errors import not_one_of

logger = logging.getLogger("fot.data")

KINDS = ("sample", "longcrawl64", "tokens", "hf")
URL_READ_RETRIES = 6
"""Extra attempts of a failed read from a URL: waits of 1, 2, 4, ... 32 s (about a minute)."""


def _prepare_hint(key: str = "data.path") -> str:
    """How to make token data, for the config key that names it."""
    return (
        "Turn text files, folders or HF datasets into a token folder with "
        f"`python -m fot.data.prepare --help`, then set {key}=<folder>."
    )


def _warn(msg: str, *args: Any) -> None:
    """Log a warning once per run: on rank 0 only (every rank builds the sources)."""
    if int(os.environ.get("RANK", "0")) == 0:
        logger.warning(msg, *args)


def is_zarr(p: Path) -> bool:
    """A zarr array or group: a ``.zarr`` path, or a folder with zarr v3 (``zarr.json``) or
    v2 (``.zarray``/``.zgroup``) metadata."""
    return p.suffix == ".zarr" or zarr_exists(p)


def _zarr_source(
    key: str,
    p: str | Path,
    seq_len: int,
    packing: str,
    storage_options: dict[str, Any] | None = None,
    cache_bytes: int | None = None,
) -> ZarrRowsSource:
    """The rows of the 2-D zarr token array ``p`` (a path or a URL) as sequences (LongCrawl64's
    layout).

    Its rows hold no document boundaries to pack by: ``packing=padded`` is refused and
    ``varlen`` packs as ``causal`` (every chunk starts with BOS either way), with a warning.
    An array behind a URL is read with retries (:data:`URL_READ_RETRIES`). ``cache_bytes``:
    see :class:`ZarrRowsSource` (``None``: sized for ``seq_len``).
    """
    if packing == "padded":
        raise ValueError(
            f"data.packing=padded needs document boundaries, but {key}={p} is a zarr array of "
            "token rows, read in chunks of data.seq_len (no padding); use data.packing=causal"
        )
    arr = open_zarr_array(p, storage_options=storage_options)
    if not np.issubdtype(np.dtype(arr.dtype), np.integer):
        raise ValueError(
            f"{p} holds {arr.dtype} values, not integer token ids; write the zarr array with an "
            "integer dtype (uint16 for GPT-2), or use `python -m fot.data.prepare`"
        )
    url = is_url(p)
    source: ZarrRowsSource = _named(
        key,
        p,
        lambda: ZarrRowsSource(
            arr,
            seq_len,
            retries=URL_READ_RETRIES if url else 0,
            name=str(p),
            chunk_exists=chunk_checker(arr, str(p), storage_options) if url else None,
            cache_bytes=cache_bytes,
        ),
    )
    _warn_if_cache_is_small(source, key)
    if packing == "varlen" and key == "data.path":
        _warn(
            "data.packing=varlen has no effect on the zarr array %s: its rows hold no document "
            "boundaries, so every chunk (starting with <|endoftext|>) is packed as with "
            "data.packing=causal; set data.packing=causal to silence this warning",
            p,
        )
    return source


def _warn_cache_unused(what: str) -> None:
    _warn(
        "data.cache_mib has no effect with %s: only 2-D zarr arrays (data=longcrawl64, or "
        "data=tokens with a .zarr) are read through the chunk cache; leave data.cache_mib out",
        what,
    )


def _warn_if_cache_is_small(source: ZarrRowsSource, key: str) -> None:
    """Warn when the chunk cache cannot hold the four chunk rows that cached reads need."""
    reader = source.reader
    if reader.cache_bytes == 0:  # data.cache_mib=0: turned off on purpose
        return
    piece = max(reader.piece_bytes(c0, c1) for c0, c1 in source.spans)
    if 4 * piece <= reader.cache_bytes:
        return
    need = -(-4 * piece // (1 << 20))
    _warn(
        "%s=%s: a chunk row across a sequence's %d columns takes %d MiB, and the chunk cache "
        "(%d MiB) holds fewer than four, so every read fetches and decodes whole chunks again "
        "for the few rows it uses; set data.cache_mib=%d (per process, for training and "
        "validation each) if the host has the memory",
        key,
        reader.name,
        source.seq_len,
        -(-piece // (1 << 20)),
        reader.cache_bytes >> 20,
        need,
    )


def _documents_source(docs: Any, seq_len: int, packing: str) -> Any:
    if packing == "padded":
        return PaddedSource(docs, seq_len)
    return PackedSource.from_documents(docs, seq_len, varlen=packing == "varlen")


def feeds_varlen(cfg: Any) -> bool:
    """Whether the batches of the ``data`` config ``cfg`` carry ``cu_seqlens`` (packed
    documents, each attending only within itself): ``data.packing=varlen`` on data with
    document boundaries. A 2-D zarr array (``data=longcrawl64``, or ``data=tokens`` with a
    ``.zarr`` or a URL) has none and packs ``varlen`` as ``causal``; held-out data counts
    where the run validates. Reads no data.

    Args:
        cfg: :class:`fot.training.config.DataConfig` (or DictConfig of it).
    """
    if cfg.packing != "varlen" or cfg.kind == "longcrawl64":
        return False
    if cfg.kind != "tokens":  # documents: the sample corpus, an HF dataset
        return True
    paths = [cfg.path]
    if cfg.val_path and int(cfg.val_tokens) > 0:
        paths.append(cfg.val_path)
    # (only zarr arrays are read from a URL; a missing path is refused when read)
    return any(not (p and (is_url(p) or is_zarr(Path(p).expanduser()))) for p in paths)


def _existing_token_path(path: str | Path, key: str) -> Path:
    """The local path ``path`` that ``key`` names (``~`` expanded); FileNotFoundError if
    nothing is there."""
    from fot.data.tokens import put_back_hint

    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"{key}={shown_path(p)} does not exist. {put_back_hint(p) or _prepare_hint(key)}"
        )
    return p


def open_token_path(
    path: str | Path,
    seq_len: int,
    packing: str,
    key: str = "data.path",
    storage_options: dict[str, Any] | None = None,
    cache_bytes: int | None = None,
    doc_start_id: int | None = None,
) -> Any:
    """A sequence source for a token folder, a flat ``.npy``/``.bin`` file or a 2-D ``.zarr``.

    Args:
        path: the data on disk, or the URL of a zarr array (``gs://``, ``s3://``, ``https://``).
        seq_len: T.
        packing: ``varlen``, ``causal`` or ``padded`` (documents only; flat files cannot pad,
            and a zarr array, having no document boundaries, packs ``varlen`` as ``causal``).
        key: the config key that named ``path``, for error messages.
        storage_options: options of a URL's filesystem (``data.storage_options``).
        cache_bytes: a zarr array's chunk cache (``data.cache_mib``; ``None``: sized for
            ``seq_len``).
        doc_start_id: the id that starts each document of a flat file (``data.doc_start_id``;
            ``None``: GPT-2's ``<|endoftext|>``).
    """
    from fot.data.tokens import TokenDocuments, is_token_folder

    if is_url(path):
        if not zarr_exists(path, storage_options):
            raise FileNotFoundError(
                f"{key}={path} holds no zarr array that could be read (no zarr.json or .zarray "
                "answered there): check the URL, the network and data.storage_options "
                "(credentials); only zarr arrays are read from a URL: copy a token folder or "
                ".npy/.bin file to a local disk and give its path"
            )
        return _zarr_source(key, str(path), seq_len, packing, storage_options, cache_bytes)
    p = _existing_token_path(path, key)
    if is_zarr(p):
        return _zarr_source(key, p, seq_len, packing, cache_bytes=cache_bytes)
    if cache_bytes is not None:
        _warn_cache_unused(f"{key}={p}, which is not a zarr array")
    if p.is_dir():
        docs = TokenDocuments(p)
        source = _named(key, p, lambda: _documents_source(docs, seq_len, packing))
        if empty := source.empty_documents:
            _warn(
                "%s=%s: data.packing=%s skips its %d empty document(s) (of %d), which would "
                "each %s",
                key,
                p,
                packing,
                empty,
                len(docs),
                "take a sequence without a token to learn"
                if packing == "padded"
                else "be a lone <|endoftext|> in the stream, with the next one as its label",
            )
        return source
    if is_token_folder(p.parent):
        why = {
            "tokens.bin": "it holds the documents back to back with no BOS between them (their "
            "boundaries are in doc_offsets.npy)",
            "doc_offsets.npy": "it holds where the documents start, not token ids",
        }.get(p.name, "a token folder is read whole")
        raise ValueError(
            f"{key}={p} is a file of the token folder {p.parent}, not token data of its own: "
            f"{why}. Set {key}={p.parent}"
        )
    if packing == "padded":
        raise ValueError(
            f"data.packing=padded needs document boundaries, but {p} is a flat token file; use "
            "a token folder (`python -m fot.data.prepare`) or data.packing=varlen/causal"
        )
    if p.suffix == ".npy":
        try:
            tokens = np.load(p, mmap_mode="r")
        except (ValueError, OSError, EOFError) as err:
            raise ValueError(
                f"{key}={p} is not a readable .npy array ({err}); save the token ids with "
                f"`np.save(path, ids.astype(np.uint16))`. {_prepare_hint(key)}"
            ) from None
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"{p} holds {tokens.dtype} values, not integer token ids; save the ids with an "
                "integer dtype (np.uint16 for GPT-2), or use `python -m fot.data.prepare`"
            )
    elif p.suffix == ".bin":
        tokens = _bin_tokens(key, p)
    else:
        raise ValueError(
            f"don't know how to read {p}: expected a token folder, a .npy/.bin (uint16) token "
            f"file or a .zarr array. {_prepare_hint(key)}"
        )
    start = EOT_ID if doc_start_id is None else int(doc_start_id)
    return _named(
        key,
        p,
        lambda: PackedSource.from_flat(
            tokens, seq_len, varlen=packing == "varlen", doc_start_id=start
        ),
    )


LLMC_MAGIC = 20240520
"""The first int32 of an llm.c / modded-nanogpt token shard's 1024-byte header (256 int32:
magic, version, token count, zeros); version 1 holds uint16 ids, version 2 uint32 ids."""
_LLMC_HEADER_BYTES = 1024


def _bin_tokens(key: str, p: Path) -> np.ndarray:
    """The token ids of the ``.bin`` file ``p`` (memory-mapped): raw uint16 ids, or an llm.c
    shard (:data:`LLMC_MAGIC`). Raw ids written in another width are refused: read as uint16,
    32-bit ids would become every other token a 0 (and pass the vocabulary check)."""
    size = p.stat().st_size
    if size >= _LLMC_HEADER_BYTES:
        magic, version, count = (int(v) for v in np.fromfile(p, dtype="<i4", count=3))
        if magic == LLMC_MAGIC:
            width = {1: 2, 2: 4}.get(version)
            if width is None or count < 0 or size != _LLMC_HEADER_BYTES + width * count:
                raise ValueError(
                    f"{key}={p} starts with an llm.c token shard's header (magic {LLMC_MAGIC}), "
                    f"but its version {version} and token count {count} do not match the "
                    f"file's {size} bytes (version 1: 2 bytes per token, 2: 4): the file is "
                    "cut short or not a shard; write it again, or write raw uint16 ids with "
                    "`ids.astype(np.uint16).tofile(path)`"
                )
            dtype = np.uint16 if width == 2 else np.uint32
            return np.memmap(p, dtype=dtype, mode="r", offset=_LLMC_HEADER_BYTES, shape=(count,))
    with open(p, "rb") as f:
        if f.read(6) == b"\x93NUMPY":
            raise ValueError(
                f"{key}={p} is a .npy file (it starts with NumPy's header), named .bin: read "
                "as raw uint16 ids, its header would be tokens. Rename it to .npy (the header "
                "records the dtype)"
            )
    if size % 2:
        raise ValueError(
            f"{key}={p} has {size} bytes, an odd number: a .bin token file must hold uint16 "
            "ids (2 bytes each); write it with `array.astype(np.uint16).tofile(path)`"
        )
    if not size:
        return np.zeros(0, np.uint16)
    tokens = np.memmap(p, dtype=np.uint16, mode="r")
    head = np.asarray(tokens[: 1 << 16])
    if head.size < 16:
        return tokens
    # Real GPT-2 ids are rarely 0..3 (`!"#$`) and rarely two printable ASCII bytes (ids
    # 8224..32382 with a printable low byte); a file written in another width or as text is
    # nearly all of one or the other (a stray header or line ending aside). Ids of 32 or 64
    # bits have high halves of 0 (1 to 3 for a vocabulary of 65,536 to 262,143 ids, as
    # Llama 3's 128,256; mostly 0 still, as frequent tokens have low ids) between low halves
    # spread over the vocabulary, unlike a uint16 file of a vocabulary of four (DNA bases),
    # small in every position, or one of symbols each followed by a space of id 1
    high, low = head[1::2], head[0::2]
    small_high = np.mean(high <= 3) >= 0.99 and np.mean(high == 0) >= 0.25
    if np.mean(high == 0) >= 0.99 or (small_high and np.mean(low > 3) >= 0.25):
        raise ValueError(
            f"{key}={p}: nearly every second uint16 of its first {head.size} is 0 to 3, as "
            "when ids are written as 32- or 64-bit integers, but a .bin token file holds "
            "uint16 ids: write it with `ids.astype(np.uint16).tofile(path)` (a vocabulary "
            "of at most 65,536 ids), or save a .npy (`np.save(path, ids)` records the dtype)"
        )
    text = np.zeros(256, bool)
    text[[9, 10, 13, *range(32, 127)]] = True
    if np.mean(text[head & 0xFF] & text[head >> 8]) >= 0.99:
        raise ValueError(
            f"{key}={p}: its first {head.size * 2} bytes are nearly all printable ASCII, as "
            "in a text file or 1-byte ids, but a .bin token file holds uint16 token ids: "
            "tokenize text with `python -m fot.data.prepare <file> --out <folder>` "
            "(data.path=<folder>), or write ids with `ids.astype(np.uint16).tofile(path)`"
        )
    return tokens


def _parent(path: str | Path) -> str | Path:
    """The folder that holds ``path`` (a local path or a URL)."""
    if isinstance(path, Path):
        return path.parent
    return path.rstrip("/").rsplit("/", 1)[0]


def _named(key: str, path: str | Path, build: Callable[[], Any]) -> Any:
    """``build()``, with a ``ValueError`` (too little data for data.seq_len, no documents)
    prefixed by the config key and path it concerns (training or held-out data)."""
    try:
        return build()
    except ValueError as err:
        raise ValueError(f"{key}={path}: {err}") from None


def _hf_dataset(cfg: Any) -> Any:
    """The :class:`fot.data.hf.HFDataset` that ``data.path``, ``data.hf_name``,
    ``data.hf_data_files`` and ``data.streaming`` name."""
    from fot.data.hf import HFDataset

    if not cfg.path:
        raise ValueError(
            "data=hf needs data.path: a dataset name on the HF hub (e.g. data.path=allenai/c4 "
            "data.hf_name=en data.streaming=true) or a loader with files (data.path=json "
            "data.hf_data_files=[/data/*.jsonl])"
        )

    files = cfg.hf_data_files
    if OmegaConf.is_config(files):  # a list or split mapping: interpolations resolved, as in a str
        files = OmegaConf.to_container(files, resolve=True)
    if not (files is None or isinstance(files, (str, list, dict))):
        raise ValueError(
            f"data.hf_data_files={files!r}: give a file or pattern, a list of them, or a "
            "split mapping such as {train: a.jsonl}"
        )
    dataset = HFDataset(
        cfg.path,
        name=cfg.hf_name,
        data_files=files,
        streaming=bool(cfg.streaming),
        where=f"data.path={cfg.path}",
        files_option="data.hf_data_files=<file, pattern or list>",
    )
    if left_out := dataset.left_out_files():
        _warn("%s", left_out)
    return dataset


def _hf_source(cfg: Any, dataset: Any, split: str, *, count: int | None = None) -> HFSource:
    """An :class:`HFSource` of one split, checked up to its first sequence (:meth:`HFSource.check`).

    Args:
        count: for held-out data: count the sequences of the split (reading it once, up to
            ``count`` sequences), so that validation never reads past its end.
    """
    from fot.data.hf import HFDataError
    from fot.tokenizer import get_encoding

    enc = get_encoding()
    option = "data.hf_split" if split == cfg.hf_split else "data.hf_val_split"
    source = HFSource(
        lambda: dataset.load(split, option),
        enc.encode_ordinary,
        cfg.seq_len,
        packing=cfg.packing,
        text_field=cfg.text_field,
        explain_error=lambda err: dataset.explain(err, split),
    )
    try:
        source.check()
        if count is not None and source.count_sequences(count) == 0:
            raise ValueError(
                f"the split holds {source.num_tokens} tokens (with a BOS per document), fewer "
                f"than data.seq_len + 1 = {cfg.seq_len + 1}; use more held-out data or a "
                "shorter data.seq_len"
            )
    except HFDataError:  # names the dataset and split already
        raise
    except ValueError as err:
        raise ValueError(f"data.path={cfg.path} split {split!r}: {err}") from None
    return source


def _val_count_limit(cfg: Any, unit: int | None = None) -> int:
    """The most held-out sequences worth counting: those ``data.val_tokens`` asks for, plus
    room for the trainer's rounding up to a multiple of ``unit`` (processes x validation micro
    batch; without it, 64 per process)."""
    need = math.ceil(int(cfg.val_tokens) / int(cfg.seq_len))
    if unit is None:
        unit = 64 * max(1, int(os.environ.get("WORLD_SIZE", "1")))
    return need + unit


def _warn_if_validating_on_training_data(cfg: Any, dataset: Any = None) -> None:
    """Warn when the held-out data is the training data: the validation loss would then
    measure memorisation, not generalisation."""
    if cfg.kind == "hf":
        split, val_split = str(cfg.hf_split), str(cfg.hf_val_split)
        shared = _shared_rows(split, val_split, dataset.files, dataset.num_rows)
        if shared is None:
            return
        how, certain = shared
        # slices of the split it trains on, quoted for Hydra inside the shell's quotes
        base = re.split(r"[\[+]", split)[0].strip() or "train"
        _warn(
            "data.hf_val_split=%s %s data.hf_split=%s (%s): validation %s the training data. "
            "Hold out a part instead (e.g. 'data.hf_split=\"%s[1%%:]\"' "
            "'data.hf_val_split=\"%s[:1%%]\"'), or map a split to other files in "
            "data.hf_data_files",
            val_split,
            "reads rows of" if certain else "may read rows of",
            split,
            how,
            "measures" if certain else "would then measure",
            base,
            base,
        )
        return
    train = Path(str(cfg.path)).expanduser().resolve()
    if Path(str(cfg.val_path)).expanduser().resolve() == train:
        _warn(
            "data.val_path=%s is the training data (data.path=%s resolves to the same %s): "
            "validation measures the training data. Hold out documents with `python -m "
            "fot.data.prepare ... --heldout-every N --heldout-out <folder>` and set "
            "data.val_path=<folder>",
            cfg.val_path,
            cfg.path,
            train,
        )


_SLICE = re.compile(
    r"^\s*([^\[\]+]+?)\s*(?:\[\s*(-?\d[\d_]*%?)?\s*:\s*(-?\d[\d_]*%?)?\s*\])?\s*(?:\((\w+)\))?\s*$"
)


@dataclass(frozen=True)
class _SplitPart:
    """One part of a datasets split expression, ``name[lo:hi](rounding)``.

    ``unit`` is ``"%"`` where either bound has a ``%`` (datasets then reads both as percents),
    else ``"abs"``; ``lo`` and ``hi`` are the bounds as written (negative: counted from the
    split's end), ``None`` where left out.
    """

    name: str
    unit: str
    lo: int | None
    hi: int | None
    rounding: str | None

    def rows(self, n: int) -> range:
        """The rows datasets reads of a split of ``n`` rows (none where it refuses the slice,
        e.g. ``pct1_dropremainder`` rounding of fewer than 100 rows)."""
        from datasets import ReadInstruction

        try:
            (rows,) = ReadInstruction(
                self.name, rounding=self.rounding, from_=self.lo, to=self.hi, unit=self.unit
            ).to_absolute({self.name: n})
        except ValueError:
            return range(0)
        return range(rows.from_, rows.to)

    def from_first_row(self) -> bool:
        return self.lo in (None, 0)

    def to_last_row(self) -> bool:
        # pct1_dropremainder rounds 100% down to a multiple of 1% of the rows
        return self.hi is None or (
            self.unit == "%" and self.hi == 100 and self.rounding != "pct1_dropremainder"
        )

    def whole(self) -> bool:
        return self.from_first_row() and self.to_last_row()

    def counted_from(self, end: bool) -> tuple[float, float] | None:
        """``(lo, hi)`` in rows counted from the split's end (``end``: negative, the end 0) or
        from its start (the end ``inf``), where both bounds count so; else ``None``."""
        if self.unit != "abs":
            return None
        if any((b < 0) != end for b in (self.lo, self.hi) if b is not None):
            return None
        lo = self.lo if self.lo is not None else (-math.inf if end else 0)
        hi = self.hi if self.hi is not None else (0 if end else math.inf)
        return lo, hi


def _split_parts(expr: str) -> list[_SplitPart] | None:
    """The parts of a datasets split expression (``train[1%:]+validation``); ``None`` for an
    expression this does not read."""
    out = []
    for part in expr.split("+"):
        m = _SLICE.match(part)
        if m is None:
            return None
        name, lo, hi, rounding = m.groups()
        unit = "%" if "%" in f"{lo}{hi}" else "abs"
        bounds = [None if b is None else int(b.rstrip("%")) for b in (lo, hi)]
        out.append(_SplitPart(name, unit, bounds[0], bounds[1], rounding))
    return out


def _lengths_to_try(parts: list[_SplitPart]) -> list[int]:
    """Split lengths at which to look for rows that parts share where the length is not known:
    every length up to 400 (percents of 200 more rows round alike), each row count written in
    the parts and the sums of two (where ranges counted from the start and from the end of the
    split begin or stop overlapping), each +-1, and some large lengths."""
    counts = {abs(b) for p in parts if p.unit == "abs" for b in (p.lo, p.hi) if b is not None}
    near = {c + d for c in counts | {a + b for a in counts for b in counts} for d in (-1, 0, 1)}
    return sorted(set(range(401)) | {n for n in near if n >= 0} | {10**k for k in range(3, 10)})


def _shared_rows(
    split: str,
    val_split: str,
    files: Callable[[str], list[str]],
    num_rows: Callable[[str], int | None] = lambda name: None,
) -> tuple[str, bool] | None:
    """How the held-out split ``val_split`` reads rows of the training split ``split`` (for the
    warning), as ``(how, certain)``; ``None`` where they are disjoint or this cannot tell.

    Parts of each that name one split are compared row by row, as datasets slices them, where
    ``num_rows`` (rows of a split by name) knows the split's length. Where it does not, they
    share rows for certain (whenever neither is empty) where one of them is the whole split,
    both start at its first row or both end at its last, or both count rows from the same end
    in ranges that overlap; else they may share rows (``certain`` False) where they do at
    some length (:func:`_lengths_to_try`), as ``train[:100]`` and ``train[-100:]`` do of fewer
    than 200 rows, and ``train[:90%]`` and ``train[-10%:]`` of 15 (13.5 and 1.5 both rounded
    up). (``train[:-100]`` and ``train[-200:]`` share rows for certain: of more than 100 rows,
    that is whenever the first is not empty.) Parts of two splits that ``files`` (the data files
    behind a split) maps to the same list of files are compared so too: datasets reads the same
    rows under both names. Parts of two splits that share files share rows where both are
    whole, or one is whole and the other's files are all among its files."""
    if split == val_split:
        return "the same split", True
    parts, val_parts = _split_parts(split), _split_parts(val_split)
    if parts is None or val_parts is None:
        return None
    maybe = None
    for part in parts:
        for val in val_parts:
            where = f"split {part.name}"
            if part.name != val.name:
                ours, theirs = files(part.name), files(val.name)
                common = sorted(set(ours) & set(theirs))
                # a whole split reads every row of its files, those of the other split's too
                if common and (
                    (part.whole() and (val.whole() or set(theirs) <= set(ours)))
                    or (val.whole() and set(ours) <= set(theirs))
                ):
                    return f"the same files: {', '.join(common[:3])}", True
                if not ours or ours != theirs:
                    continue
                # the same files in the same order: both names read the same rows
                where = f"splits {part.name} and {val.name}, which read the same files"
            n = num_rows(part.name)
            if n is not None:
                both = _common(part.rows(n), val.rows(n))
                if both:
                    return f"both read rows {both.start}-{both.stop - 1} of {where}", True
                continue
            lengths = [
                k for k in _lengths_to_try([part, val]) if _common(part.rows(k), val.rows(k))
            ]
            if not lengths:
                continue
            if part.whole() or val.whole():
                return f"both read {where}, one of them whole", True
            if (part.from_first_row() and val.from_first_row()) or (
                part.to_last_row() and val.to_last_row()
            ):
                return f"both read {where}, from its first row or to its last", True
            for end in (False, True):
                a, b = part.counted_from(end), val.counted_from(end)
                if a and b and max(a[0], b[0]) < min(a[1], b[1]):
                    return f"both read {where}, in ranges that overlap", True
            if maybe is None:  # named at a length that is not tiny, where there is one
                k = max([k for k in lengths if k <= 1000] or lengths[:1])
                both = _common(part.rows(k), val.rows(k))
                maybe = (
                    f"depending on the length of {where}, not known here: of {k} rows, "
                    f"both would read rows {both.start}-{both.stop - 1}"
                )
    return None if maybe is None else (maybe, False)


def _common(a: range, b: range) -> range:
    """The rows two ranges of step 1 share."""
    return range(max(a.start, b.start), min(a.stop, b.stop))


def _refuse_unused_paths(cfg: Any) -> None:
    """Refuse ``data.path``/``data.val_path`` where the data kind would silently ignore them.

    ``data=sample`` reads the built-in corpus and ``data=hf`` takes its held-out data from
    ``data.hf_val_split``: a path given there would otherwise train on other data than asked.
    """
    if cfg.kind == "sample":
        for key in ("path", "val_path"):
            value = getattr(cfg, key, None)
            if value:
                raise ValueError(
                    f"data.{key}={value} is not read by data=sample (the built-in corpus); "
                    "select the data group that reads it: data=tokens for a token folder or "
                    ".bin/.npy/.zarr file, data=longcrawl64, or data=hf for an HF dataset"
                )
    elif cfg.kind == "hf" and getattr(cfg, "val_path", None):
        raise ValueError(
            f"data.val_path={cfg.val_path} is not read by data=hf: set data.hf_val_split=<split> "
            "for held-out data from the same dataset, or use data=tokens with a token folder "
            "(`python -m fot.data.prepare`)"
        )


def check_data_paths(cfg: Any) -> None:
    """Refuse a ``data`` config whose data :func:`build_sources` would refuse for a path:
    a path the data kind needs but does not have, or a local ``data.path``/``data.val_path``
    (or LongCrawl64's train.zarr/heldout.zarr under it) that does not exist. Reads no data
    and asks no URL (those are checked when read), so it is cheap enough to run for every job
    of a sweep before the first one trains.

    Args:
        cfg: :class:`fot.training.config.DataConfig` (or DictConfig of it).

    Raises:
        ValueError: a path given to a kind that does not read it, or none given to one that
            needs it.
        FileNotFoundError: a local path that does not exist, with the message the loader
            gives.
    """
    _refuse_unused_paths(cfg)
    want_val = cfg.val_tokens > 0
    if cfg.kind == "tokens":
        if not cfg.path:
            raise ValueError(f"data=tokens needs data.path. {_prepare_hint()}")
        for key, path in (("data.path", cfg.path), ("data.val_path", cfg.val_path)):
            if path and not is_url(path) and (key == "data.path" or want_val):
                _existing_token_path(path, key)
    elif cfg.kind == "longcrawl64":
        _require_longcrawl64_path(cfg)
        if not is_url(cfg.path):
            root = Path(cfg.path).expanduser()
            train_path = _local_longcrawl64_train(root)
            val_path = _longcrawl64_val_path(cfg, root, train_path)
            if want_val and not is_url(val_path) and not Path(val_path).expanduser().exists():
                raise _missing_heldout(Path(val_path).expanduser())


def build_sources(cfg: Any, *, val_unit: int | None = None) -> tuple[Any, Any | None]:
    """Training and held-out sources for a ``data`` config.

    Args:
        cfg: :class:`fot.training.config.DataConfig` (or DictConfig of it).
        val_unit: what validation reads a multiple of (processes x validation micro batch);
            an HF held-out split is counted that far past ``data.val_tokens``. Default:
            ``64 * WORLD_SIZE``.

    Returns:
        ``(train_source, val_source)``; ``val_source`` is ``None`` when the config has no
        held-out data or ``val_tokens == 0``.
    """
    if cfg.kind not in KINDS:
        raise ValueError(not_one_of("data.kind", cfg.kind, KINDS))
    if cfg.packing not in PACKINGS:
        raise ValueError(not_one_of("data.packing", cfg.packing, PACKINGS))
    _refuse_unused_paths(cfg)
    if cfg.kind in ("sample", "hf") and getattr(cfg, "cache_mib", None) is not None:
        _warn_cache_unused(f"data={cfg.kind}")
    T = int(cfg.seq_len)
    want_val = cfg.val_tokens > 0
    if cfg.kind == "sample":
        from fot.data.sample import sample_token_documents

        # the corpus as data.text_escaping says the export will record (json: as LongCrawl64's)
        escaping = getattr(cfg, "text_escaping", None) or "none"
        train = _documents_source(sample_token_documents("train", escaping), T, cfg.packing)
        val = _documents_source(sample_token_documents("heldout", escaping), T, cfg.packing)
        return train, val if want_val else None
    if cfg.kind == "longcrawl64":
        return _longcrawl64_sources(cfg, T, want_val)
    if cfg.kind == "tokens":
        if not cfg.path:
            raise ValueError(f"data=tokens needs data.path. {_prepare_hint()}")
        options, cache = _storage_options(cfg), _cache_bytes(cfg)
        start = getattr(cfg, "doc_start_id", None)
        train = open_token_path(
            cfg.path,
            T,
            cfg.packing,
            storage_options=options,
            cache_bytes=cache,
            doc_start_id=start,
        )
        val = None
        if cfg.val_path and want_val:
            val = open_token_path(
                cfg.val_path,
                T,
                cfg.packing,
                key="data.val_path",
                storage_options=options,
                cache_bytes=cache,
                doc_start_id=start,
            )
            _warn_if_validating_on_training_data(cfg)
        return train, val
    dataset = _hf_dataset(cfg)
    train = _hf_source(cfg, dataset, cfg.hf_split)
    val = None
    if cfg.hf_val_split and want_val:
        # counted once here: validation reads the split at most once, never wrapping around
        val = _hf_source(cfg, dataset, cfg.hf_val_split, count=_val_count_limit(cfg, val_unit))
        _warn_if_validating_on_training_data(cfg, dataset)
    return train, val


def _storage_options(cfg: Any) -> dict[str, Any] | None:
    """``data.storage_options`` as a plain dict (``None`` when unset)."""
    options = getattr(cfg, "storage_options", None)
    if not options:
        return None
    if OmegaConf.is_config(options):
        options = OmegaConf.to_container(options, resolve=True)
    if not isinstance(options, dict):
        raise ValueError(
            f"data.storage_options={options!r} must be a mapping of the URL filesystem's "
            "options, e.g. ++data.storage_options={token:anon}"
        )
    return options


def _cache_bytes(cfg: Any) -> int | None:
    """``data.cache_mib`` in bytes (``None``: sized by the reader)."""
    mib = getattr(cfg, "cache_mib", None)
    if mib is None:
        return None
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
        raise ValueError(
            f"data.cache_mib={mib!r} must be a whole number of MiB >= 0 (0: no chunk cache), "
            "or null to size the cache for data.seq_len"
        )
    return mib << 20


def _require_longcrawl64_path(cfg: Any) -> None:
    """Refuse data=longcrawl64 without ``data.path``."""
    if not cfg.path:
        raise ValueError(
            "data=longcrawl64 needs data.path: the folder with LongCrawl64's train.zarr and "
            "heldout.zarr (https://manifestai.com/articles/longcrawl64), on a disk or behind a "
            "URL that is streamed (gs://<bucket>/longcrawl64 with `pip install gcsfs`, s3://, "
            "https://)."
        )


def _local_longcrawl64_train(root: Path) -> Path:
    """LongCrawl64's ``train.zarr`` under the local folder ``root``, or ``root`` itself when it
    is the array; FileNotFoundError if neither is there."""
    train_path = root / "train.zarr" if (root / "train.zarr").exists() else root
    if not train_path.exists() or (train_path == root and not is_zarr(root)):
        raise FileNotFoundError(
            f"no LongCrawl64 train.zarr under {shown_path(root)}. Download train.zarr and heldout.zarr "
            "from https://manifestai.com/articles/longcrawl64 into that folder, or stream "
            "them from a URL (data.path=gs://<bucket>/longcrawl64, s3://, https://)."
        )
    return train_path


def _longcrawl64_val_path(cfg: Any, root: str | Path, train_path: str | Path) -> str | Path:
    """Where LongCrawl64's held-out array is: ``data.val_path``, else ``heldout.zarr`` next to
    ``train.zarr`` (also when ``data.path`` names train.zarr itself)."""
    folder = root if str(train_path) != str(root) else _parent(root)
    return cfg.val_path or join(folder, "heldout.zarr")


def _missing_heldout(val_path: str | Path) -> FileNotFoundError:
    """The error for LongCrawl64's held-out array not found at ``val_path``."""
    return FileNotFoundError(
        f"held-out data {shown_path(val_path)} not found; put heldout.zarr next to train.zarr, set "
        "data.val_path, or data.val_tokens=0 to skip validation"
    )


def _longcrawl64_sources(cfg: Any, T: int, want_val: bool) -> tuple[Any, Any | None]:
    """LongCrawl64's ``train.zarr`` (and ``heldout.zarr``) under ``data.path``: a folder, a URL
    (``gs://<bucket>/longcrawl64``, streamed), or the arrays themselves."""
    _require_longcrawl64_path(cfg)
    options = _storage_options(cfg)
    url = is_url(cfg.path)
    if url:
        root: str | Path = str(cfg.path).rstrip("/")
        train_path: str | Path = join(root, "train.zarr")
        if not zarr_exists(train_path, options):
            train_path = root
            if not zarr_exists(root, options):
                raise FileNotFoundError(
                    f"no LongCrawl64 train.zarr at {root}: neither {join(root, 'train.zarr')} "
                    "nor the URL itself holds a zarr array; check the URL, the network and "
                    "data.storage_options (credentials)."
                )
    else:
        root = Path(cfg.path).expanduser()
        train_path = _local_longcrawl64_train(root)
    cache = _cache_bytes(cfg)
    train = _zarr_source("data.path", train_path, T, cfg.packing, options, cache)
    if not want_val:
        return train, None
    val_path = _longcrawl64_val_path(cfg, root, train_path)
    if is_url(val_path):
        found = zarr_exists(val_path, options)
    else:
        val_path = Path(val_path).expanduser()
        found = val_path.exists()
    if not found:
        raise _missing_heldout(val_path)
    same = (
        str(val_path).rstrip("/") == str(train_path).rstrip("/")
        if url or is_url(val_path)
        else Path(val_path).resolve() == Path(train_path).resolve()
    )
    if same:
        _warn(
            "data.val_path=%s is the training array %s: validation measures the training "
            "data; point data.val_path to held-out rows (heldout.zarr)",
            cfg.val_path,
            train_path,
        )
    return train, _zarr_source("data.val_path", val_path, T, cfg.packing, options, cache)
