"""Training streams: deterministic, rank-sharded, exactly resumable sequences of token ids.

Everything here is built from one idea: a *sequence source* numbers the training sequences of
a corpus ``0, 1, 2, ...`` (wrapping around into further epochs), and a
:class:`SequenceStream` hands each step's global batch (``global_batch_size`` consecutive
sequences) to the ranks, each rank taking a contiguous block and cutting it into micro batches.
The stream's position is the number of sequences consumed, so the split of a global batch does
not depend on the world size, resuming is exact, and memory stays constant.

Conventions (GPT-2 ids; ``EOT_ID = 50256`` is ``<|endoftext|>``):

* **BOS**: every document starts with one ``<|endoftext|>`` token. Token folders store
  documents without it; the readers insert it. Predicting it at the end of the previous
  document (packed streams) is how the model learns where a document ends.
* **LongCrawl64** (and any 2-D zarr of rows): each row is one document. It is cut into
  ``row_len // seq_len`` chunks; chunk ``c`` of a row gives ``labels = row[cT:cT+T]`` and
  ``input_ids = [EOT] + row[cT:cT+T-1]`` (every chunk starts with BOS, all T labels count).
  Sequences are numbered column-major, as in the paper's code: the first chunk of every row,
  then the second chunk of every row, and so on.
* **Packed documents** (``packing="varlen"`` or ``"causal"``): the documents, each with its
  BOS, are concatenated into one stream; sequence ``g`` is ``stream[gT : gT+T+1]`` (inputs
  the first T, labels the last T), so all labels count. ``"varlen"`` adds ``cu_seqlens`` at
  every BOS so no token attends across documents; ``"causal"`` leaves attention unmasked.
  Empty documents are skipped (each would be a lone BOS, the next BOS its label).
* **Padded documents** (``packing="padded"``): sequence ``g`` is non-empty document
  ``g mod N``, BOS first and EOT after it, truncated to ``T + 1`` tokens (the rest of a longer
  document is dropped), padded with EOT; padded positions have label ``-100``. A document
  shorter than ``T`` thus has its end (EOT) as a label, as in a packed stream; empty documents
  are skipped.
* A flat ``.npy``/``.bin`` token file is taken as already packed (GPT-2 style, documents
  separated by EOT) and read like a packed stream, without inserting anything.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fot.data.zarr_store import ChunkReader, cache_bytes_for
from fot.errors import not_one_of

EOT_ID = 50256
"""``<|endoftext|>`` in GPT-2: used as BOS before every document and as padding."""
IGNORE_INDEX = -100
PACKINGS = ("varlen", "causal", "padded")


@dataclass
class Batch:
    """One micro batch.

    Attributes:
        input_ids: ``[B, T]`` int64.
        labels: ``[B, T]`` int64 next tokens, ``-100`` where ignored.
        cu_seqlens: ``None``, or ``[N+1]`` int32 document boundaries in the flattened batch
            (then ``B == 1``; rows of the micro batch are laid end to end).
        seq_len: length of one training sequence (``T * B_rows == numel`` for varlen).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor | None
    seq_len: int

    def to(self, device: torch.device | str) -> Batch:
        """Copy to ``device``; from the CPU to CUDA through pinned memory, so the copy does not
        wait for the GPU."""
        nb = torch.device(device).type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            if nb and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            return t.to(device, non_blocking=nb)

        return Batch(
            move(self.input_ids),
            move(self.labels),
            None if self.cu_seqlens is None else move(self.cu_seqlens),
            self.seq_len,
        )

    @property
    def num_tokens(self) -> int:
        """Number of input positions."""
        return self.input_ids.numel()

    def num_label_tokens(self) -> int:
        """Number of positions whose label counts (not ``-100``)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def document_lengths(self) -> np.ndarray:
        """Lengths of the spans attention sees separately, int64 on the host: the documents
        of ``cu_seqlens`` (varlen packing), else the ``B`` rows of ``T`` tokens. Read from a
        batch still on the CPU (as the streams make them)."""
        if self.cu_seqlens is None:
            rows, t = self.input_ids.shape
            return np.full(rows, t, dtype=np.int64)
        return np.diff(self.cu_seqlens.numpy()).astype(np.int64)


class SequenceSource(Protocol):
    """Numbers a corpus' training sequences; see the module docstring."""

    seq_len: int
    sequential: bool
    """True when ``read`` must be called with consecutive ``start`` values (HF streaming)."""

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequences ``start .. start+count-1`` as ``(input_ids, labels)``, each
        ``[count, seq_len]`` int64."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beyond the sequence number: a sequential source's place in its
        documents (``HFSource``); empty for sources that read any ``start``."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of the same source."""
        ...


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"data.seq_len must be an integer >= 2, got {seq_len!r}")


# --------------------------------------------------------------------------------------------
# 2-D zarr rows (LongCrawl64)
# --------------------------------------------------------------------------------------------


class ZarrRowsSource:
    """Rows of a 2-D token array (LongCrawl64 ``train.zarr``/``heldout.zarr``), cut into chunks.

    Reads go through a :class:`fot.data.zarr_store.ChunkReader`: whole zarr chunks, cached,
    fetched ahead by :meth:`prefetch`, retried when the array is behind a URL.

    Args:
        array: ``[R, L]`` array-like of token ids supporting 2-D slicing (zarr array, numpy).
        seq_len: T; must be at most L. ``L // T`` chunks per row are used (a remainder at the
            end of each row is skipped: :meth:`remainder_warning`).
        retries: extra attempts of a failed read (data behind a URL); 0 for local data.
        name: the array's path or URL, for messages.
        chunk_exists: whether a chunk is stored (data behind a URL): a chunk that is not stops
            the read with an error instead of reading as the fill value.
        cache_bytes: host memory for whole chunks (``data.cache_mib``); ``None``: room for four
            chunk rows across a sequence's columns (:func:`fot.data.zarr_store.cache_bytes_for`).
    """

    sequential = False

    def __init__(
        self,
        array: Any,
        seq_len: int,
        *,
        retries: int = 0,
        name: str = "the zarr array",
        chunk_exists: Callable[[tuple[int, int]], bool] | None = None,
        cache_bytes: int | None = None,
    ) -> None:
        _check_seq_len(seq_len)
        if len(array.shape) != 2:
            raise ValueError(f"expected a 2-D [rows, row_len] token array, got shape {array.shape}")
        self.reader = ChunkReader(array, retries=retries, name=name, chunk_exists=chunk_exists)
        self.seq_len = seq_len
        self.rows = int(array.shape[0])
        self.row_len = int(array.shape[1])
        if self.rows < 1:
            raise ValueError("the token array has no rows")
        if seq_len > self.row_len:
            raise ValueError(
                f"data.seq_len={seq_len} is longer than a row ({self.row_len} tokens); "
                f"use data.seq_len <= {self.row_len}"
            )
        self.chunks_per_row = self.row_len // seq_len
        self.num_sequences = self.rows * self.chunks_per_row
        """Sequences in one epoch."""
        self.spans = [(c * seq_len, c * seq_len + seq_len) for c in range(self.chunks_per_row)]
        """The column spans ``(c0, c1)`` that sequences are read from."""
        self.reader.cache_bytes = (
            cache_bytes_for(self.reader, self.spans) if cache_bytes is None else int(cache_bytes)
        )

    def remainder_warning(self, key: str = "data.seq_len") -> str | None:
        """A warning where ``seq_len`` does not divide the rows: the tokens after the last
        whole sequence of every row are never read. It names the share of the data lost and
        the divisors of the row length nearest to ``seq_len`` (``key``: the setting to change).
        ``None`` where ``seq_len`` divides the rows."""
        left = self.row_len - self.chunks_per_row * self.seq_len
        if not left:
            return None
        divisors = [d for d in range(2, self.row_len + 1) if self.row_len % d == 0]
        below = [d for d in divisors if d < self.seq_len][-1:]
        above = [d for d in divisors if d > self.seq_len][:1]
        return (
            f"{key}={self.seq_len} does not divide the rows of {self.reader.name} "
            f"({self.row_len} tokens each): each row gives {self.chunks_per_row} sequence(s) "
            f"and its last {left} tokens are never read, {100 * left / self.row_len:.3g}% of the "
            f"data. Use a {key} that divides {self.row_len}, e.g. "
            + " or ".join(str(d) for d in below + above)
        )

    def _spans(self, start: int, count: int) -> Iterator[tuple[int, int, int, int]]:
        """``(done, row, n, column)``: runs of rows at one column that sequences
        ``start .. start+count-1`` come from, ``done`` sequences before each."""
        done = 0
        while done < count:
            g = (start + done) % self.num_sequences
            col, row = divmod(g, self.rows)
            n = min(count - done, self.rows - row)
            yield done, row, n, col
            done += n

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        T = self.seq_len
        labels = np.empty((count, T), dtype=np.int64)
        for done, row, n, col in self._spans(start, count):
            labels[done : done + n] = self.reader.read(row, row + n, col * T, col * T + T)
        inputs = np.empty_like(labels)
        inputs[:, 0] = EOT_ID
        inputs[:, 1:] = labels[:, :-1]
        return inputs, labels

    def prefetch(self, start: int, count: int) -> None:
        """Start reading sequences ``start .. start+count-1`` in the background (the next
        step's), so that :meth:`read` finds them fetched."""
        T = self.seq_len
        for _, row, n, col in self._spans(start, count):
            self.reader.prefetch(row, row + n, col * T, col * T + T)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# --------------------------------------------------------------------------------------------
# packed token streams (documents with BOS, or flat token files)
# --------------------------------------------------------------------------------------------


def _empty_documents(offsets: np.ndarray) -> np.ndarray:
    """Indices of the documents without tokens, from the ``[N+1]`` document offsets."""
    return np.flatnonzero(offsets[1:] == offsets[:-1])


def _nonempty_documents(empty: np.ndarray) -> Callable[[int], int]:
    """``k -> i``: the index among all documents of the ``k``-th non-empty one, given the
    indices ``empty`` of the empty ones (ascending)."""
    if not len(empty):
        return lambda k: k
    # for each empty document, the non-empty ones before it: the k-th non-empty document
    # is document k + (empty documents whose count is <= k)
    before = empty - np.arange(len(empty))
    return lambda k: k + int(np.searchsorted(before, k, side="right"))


def _no_documents_to_train_on(docs: int) -> str:
    return (
        "no documents to train on"
        if docs == 0
        else f"no documents to train on: all {docs} documents are empty"
    )


def _doc_offsets(docs: Sequence[np.ndarray]) -> np.ndarray:
    offsets = getattr(docs, "offsets", None)
    if offsets is not None:
        return np.asarray(offsets, dtype=np.int64)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


class PackedSource:
    """A token stream cut into sequences of ``seq_len`` (+1 for the last label).

    Build it with :meth:`from_documents` (BOS inserted before every document) or
    :meth:`from_flat` (a flat token array used as is). Sequence ``g`` of epoch ``e`` starts at
    stream position ``g * seq_len`` modulo the stream length; a sequence that runs past the end
    continues at the start (the stream is cyclic).

    Args:
        read_tokens: ``(start, n) -> int array`` of ``n`` stream tokens from ``start``
            (``start + n <= length``).
        length: stream length in tokens.
        seq_len: T.
        varlen: emit document boundaries (positions holding EOT) as ``cu_seqlens``.
    """

    sequential = False

    def __init__(
        self,
        read_tokens: Callable[[int, int], np.ndarray],
        length: int,
        seq_len: int,
        *,
        varlen: bool,
    ) -> None:
        _check_seq_len(seq_len)
        if length < seq_len + 1:
            raise ValueError(
                f"the token stream has {length} tokens, fewer than data.seq_len + 1 = "
                f"{seq_len + 1}; use more data or a shorter data.seq_len"
            )
        self._read_tokens = read_tokens
        self.length = length
        self.seq_len = seq_len
        self.varlen = varlen
        self.num_sequences = (length - 1) // seq_len
        """Sequences whose tokens and labels all lie in one pass over the stream (the last
        label needs the token after the last input): what validation may read without
        wrapping around."""

    doc_start_id = EOT_ID
    """The id that starts each document in the stream (``varlen`` boundaries): EOT, which
    fot's readers put before every document, or a flat file's own (:meth:`from_flat`)."""

    empty_documents = 0
    """Documents without tokens, which the stream skips (:meth:`from_documents`): each would
    be a lone BOS whose label is the next document's BOS."""

    @classmethod
    def from_documents(
        cls, docs: Sequence[np.ndarray], seq_len: int, *, varlen: bool = True
    ) -> PackedSource:
        """Pack documents (token arrays without BOS), inserting EOT before each; empty
        documents are skipped (:attr:`empty_documents`).

        A token folder's documents (:class:`fot.data.tokens.TokenDocuments`) are read from its
        ``tokens.bin`` memmap, where they lie back to back; other documents are joined into
        one array first. A read finds the documents of its window with one ``searchsorted``
        over their stream positions (an int64 per non-empty document, kept in memory as the
        folder's ``doc_offsets.npy`` is) and copies their tokens with one slice.
        """
        offsets = _doc_offsets(docs)
        nonempty = np.flatnonzero(offsets[1:] > offsets[:-1])
        if not len(nonempty):
            raise ValueError(_no_documents_to_train_on(len(docs)))
        # the stream is the non-empty documents' tokens back to back, with a BOS inserted
        # before each: here, at its offset plus one for every earlier BOS
        bos = offsets[nonempty] + np.arange(len(nonempty))
        # a token folder's tokens.bin (memmap): document i is tokens[offsets[i]:offsets[i + 1]]
        tokens = getattr(docs, "tokens", None) if hasattr(docs, "offsets") else None
        if tokens is None:
            tokens = np.concatenate([np.asarray(docs[i]) for i in nonempty])

        def read(start: int, n: int) -> np.ndarray:
            # the BOS before the window and before its end; the tokens between them follow
            # one another in `tokens`
            lo, hi = np.searchsorted(bos, [start, start + n])
            out = np.empty(n, dtype=np.int64)
            at = bos[lo:hi] - start
            is_token = np.ones(n, dtype=bool)
            is_token[at] = False
            out[is_token] = tokens[start - lo : start + n - hi]
            out[at] = EOT_ID
            return out

        source = cls(read, int(offsets[-1]) + len(nonempty), seq_len, varlen=varlen)
        source.empty_documents = len(docs) - len(nonempty)
        return source

    @classmethod
    def from_flat(
        cls,
        tokens: np.ndarray,
        seq_len: int,
        *,
        varlen: bool = True,
        doc_start_id: int = EOT_ID,
    ) -> PackedSource:
        """Use a flat 1-D token array (memmap) as the packed stream, whose documents each
        start with ``doc_start_id`` (GPT-2's EOT; another tokenizer's BOS)."""
        if tokens.ndim != 1:
            raise ValueError(f"a flat token file must be 1-D, got shape {tokens.shape}")
        source = cls(
            lambda s, n: np.array(tokens[s : s + n], dtype=np.int64),
            len(tokens),
            seq_len,
            varlen=varlen,
        )
        source.doc_start_id = int(doc_start_id)
        return source

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        T = self.seq_len
        # sequence start + j is window[jT : jT + T + 1]: one read of the tokens they span
        # (consecutive sequences share a token), continued at the stream's start where it ends
        left, pos, pieces = count * T + 1, start * T % self.length, []
        while left:
            n = min(left, self.length - pos)
            pieces.append(self._read_tokens(pos, n))
            left, pos = left - n, 0
        window = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return window[:-1].reshape(count, T), window[1:].reshape(count, T).copy()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PaddedSource:
    """One document per sequence (BOS first, EOT after it, truncated to T+1 tokens, EOT
    padding, label -100); empty documents are skipped (:attr:`empty_documents`).

    Args:
        docs: documents (token arrays without BOS).
        seq_len: T.
    """

    sequential = False
    varlen = False

    def __init__(self, docs: Sequence[np.ndarray], seq_len: int) -> None:
        _check_seq_len(seq_len)
        empty = _empty_documents(_doc_offsets(docs))
        self.empty_documents = len(empty)
        """Documents without tokens, which no sequence holds."""
        if len(docs) == self.empty_documents:
            raise ValueError(_no_documents_to_train_on(len(docs)))
        self.docs = docs
        self.seq_len = seq_len
        self.num_sequences = len(docs) - self.empty_documents
        self._doc = _nonempty_documents(empty)

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        T = self.seq_len
        inputs = np.full((count, T), EOT_ID, dtype=np.int64)
        labels = np.full((count, T), IGNORE_INDEX, dtype=np.int64)
        for j in range(count):
            _pad_row(self.docs[self._doc((start + j) % self.num_sequences)], inputs[j], labels[j])
        return inputs, labels

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _pad_row(doc: np.ndarray, inputs: np.ndarray, labels: np.ndarray) -> None:
    """Write BOS, ``doc`` and EOT, cut to ``T + 1`` tokens, into a padded row's ``[T]``
    ``inputs`` and ``labels`` (filled with EOT and -100 beforehand): the EOT is a label, as
    in a packed stream, unless the document fills the row."""
    T = len(inputs)
    n = min(len(doc), T)
    x = np.empty(min(len(doc) + 2, T + 1), dtype=np.int64)
    x[0] = EOT_ID
    x[1 : n + 1] = doc[:n]
    if n + 1 < len(x):
        x[n + 1] = EOT_ID
    inputs[: len(x) - 1] = x[:-1]
    labels[: len(x) - 1] = x[1:]


# --------------------------------------------------------------------------------------------
# HF datasets, tokenized on the fly
# --------------------------------------------------------------------------------------------


class HFSource:
    """Documents from a Hugging Face dataset (map-style or streaming), tokenized on the fly.

    Sequential: every rank walks the whole document stream (tokenizing it) and keeps its own
    share, so the global batch is the same for every world size. For large corpora, tokenize
    once with ``python -m fot.data.prepare`` and train on the token folder instead.

    Packed, the reader holds the current document (BOS first) and an offset into it, so a
    sequence costs O(T) however long the document. The state is the number of documents
    consumed and that offset (a few numbers, whatever the document's length); resuming skips
    all but the last of those documents (``IterableDataset.skip`` or indexing) and reads that
    one again. A state with the carried-over tokens themselves (``buffer``, as written before)
    still resumes exactly.

    Rows whose text is empty (an empty CSV cell) or ``None`` (a null) are skipped, as
    ``python -m fot.data.prepare`` skips empty documents.

    Args:
        make_dataset: returns a fresh dataset (``datasets.Dataset`` or ``IterableDataset``).
        encode: text -> list of token ids (e.g. ``fot.tokenizer.get_encoding().encode_ordinary``).
        seq_len: T.
        packing: ``"varlen"``, ``"causal"`` or ``"padded"``.
        text_field: column holding the text; if the rows instead hold ``input_ids`` (GPT-2
            ids), they are used as tokens directly, a leading ``<|endoftext|>`` (the BOS of
            fot's tokenizer) left out, as the reader puts one before every document.
        explain_error: turns an error raised while iterating the dataset (a bad file met by a
            streaming dataset) into a clearer one, or returns ``None`` to keep it.
    """

    sequential = True

    def __init__(
        self,
        make_dataset: Callable[[], Any],
        encode: Callable[[str], list[int]],
        seq_len: int,
        *,
        packing: str = "varlen",
        text_field: str = "text",
        explain_error: Callable[[Exception], Exception | None] | None = None,
    ) -> None:
        _check_seq_len(seq_len)
        if packing not in PACKINGS:
            raise ValueError(not_one_of("data.packing", packing, PACKINGS))
        self.make_dataset = make_dataset
        self.encode = encode
        self.seq_len = seq_len
        self.packing = packing
        self.varlen = packing == "varlen"
        self.text_field = text_field
        self.explain_error = explain_error
        self.num_sequences: int | None = None
        """Sequences the dataset holds without wrapping around, where counted
        (:meth:`count_sequences`; held-out data); ``None``: a stream of unknown length."""
        self.num_tokens: int | None = None
        """Tokens of the packed stream (documents with their BOS) that counting read."""
        self.position = 0  # next sequence index
        self.docs_consumed = 0  # over all epochs
        self.docs_per_epoch: int | None = None
        # packed: [EOT] + tokens of the current document (row docs_consumed - 1); the next
        # sequence starts at _doc[_offset] (the tokens after it are the carry)
        self._doc = np.zeros(0, dtype=np.int64)
        self._offset = 0
        self._doc_is_row = True  # False: _doc is a carry restored as is (see _restore)
        self._pending: dict[str, Any] | None = None  # a loaded state not yet restored
        self._it: Iterator[Any] | None = None

    def _open(self) -> Iterator[Any]:
        ds = self.make_dataset()
        skip = self.docs_consumed
        if self.docs_per_epoch:
            skip %= self.docs_per_epoch
        if hasattr(ds, "__len__") and hasattr(ds, "select"):
            return (ds[i] for i in range(skip, len(ds)))
        return iter(ds.skip(skip) if skip else ds)

    def _next_row(self, it: Iterator[Any]) -> Any:
        """``next(it)``; ``StopIteration`` passes, other errors go through ``explain_error``."""
        try:
            return next(it)
        except StopIteration:
            raise
        except Exception as err:
            new = self.explain_error(err) if self.explain_error is not None else None
            if new is None:
                raise
            raise new from err

    def _next_doc(self) -> np.ndarray:
        """Tokens of the next non-empty document (into the next epoch at the end)."""
        if self._it is None:
            self._it = self._open()
        restarted = False
        while True:
            try:
                row = self._next_row(self._it)
            except StopIteration:
                # the end of the dataset twice in one call: a whole epoch without a document
                if restarted or self.docs_consumed == 0:
                    raise ValueError(
                        _no_documents(self.docs_per_epoch or self.docs_consumed)
                    ) from None
                self.docs_per_epoch = self.docs_per_epoch or self.docs_consumed
                self._it = iter(self.make_dataset())  # next epoch from the start
                restarted = True
                continue
            self.docs_consumed += 1  # rows, empty ones included: resuming skips this many
            ids = self._tokens(row, self.docs_consumed - 1)
            if len(ids):
                return ids

    def _tokens(self, row: dict[str, Any], index: int) -> np.ndarray:
        """Token ids of one dataset row (its ``text_field``, else its ``input_ids``); a row
        without either, or with a value of the wrong type, is a ``ValueError`` naming it."""
        if self.text_field in row:
            text = row[self.text_field]
            if text is None:  # a null, a missing field: an empty document, skipped
                return np.zeros(0, dtype=np.int64)
            if not isinstance(text, str):
                raise ValueError(
                    f"dataset row {index}: column {self.text_field!r} holds {text!r} "
                    f"({type(text).__name__}), not text; set data.text_field to the text "
                    "column, or fix that row"
                )
            return np.asarray(self.encode(text), dtype=np.int64)
        if "input_ids" in row:
            try:
                ids = np.asarray(row["input_ids"])
            except ValueError:  # ragged nested lists
                ids = np.asarray([0.5])
            if ids.size and not (ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(
                    f"dataset row {index}: column 'input_ids' is not a list of token ids; give "
                    "integer ids, or a text column with data.text_field"
                )
            # ids from fot's tokenizer (tok(text)) start with the BOS this reader puts before
            # every document: one BOS, not a one-token document before each
            if ids.size and int(ids[0]) == EOT_ID:
                ids = ids[1:]
            return ids.astype(np.int64)
        raise ValueError(
            f"dataset row {index} has columns {sorted(row)}, no {self.text_field!r} (or "
            "'input_ids'); set data.text_field to the text column"
        )

    def _rows(self) -> Iterator[Any]:
        """One pass over a fresh copy of the dataset (the stream's position is untouched)."""
        it = iter(self.make_dataset())
        while True:
            try:
                yield self._next_row(it)
            except StopIteration:
                return

    def check(self) -> None:
        """Read the dataset up to its first document and check it as training will (text
        column, type), so that a wrong ``data.text_field`` is reported before a run starts,
        not at its first step; with packing, read on until the documents fill one sequence
        (``seq_len + 1`` tokens with their BOS), as a token folder must.

        Raises:
            ValueError: the dataset has no rows, only empty texts, its first row has no
                usable text, or (packed) it holds fewer than ``seq_len + 1`` tokens.
        """
        rows = length = 0
        for row in self._rows():
            rows += 1
            n = len(self._tokens(row, rows - 1))
            length += n + 1 if n else 0
            if n and (self.packing == "padded" or length >= self.seq_len + 1):
                return
        if not length:
            raise ValueError(_no_documents(rows))
        # the stream would repeat these documents within every sequence
        raise ValueError(
            f"the split holds {length} tokens (with a BOS per document), fewer than "
            f"data.seq_len + 1 = {self.seq_len + 1}; use more data or a shorter data.seq_len"
        )

    def count_sequences(self, limit: int) -> int:
        """Count the sequences one pass over the dataset gives without wrapping around, and
        keep the count in :attr:`num_sequences` (validation then reads no further).

        Reading stops once ``limit`` sequences are found: a larger dataset counts as ``limit``.

        Args:
            limit: the most sequences to count (>= 1).

        Returns:
            ``min(sequences, limit)``: with packing, ``(L - 1) // seq_len`` for a stream of
            ``L`` tokens (every document with its BOS; the last label must exist); padded,
            the number of documents.
        """
        docs = length = count = 0
        for i, row in enumerate(self._rows()):
            n = len(self._tokens(row, i))
            if not n:
                continue
            docs += 1
            length += n + 1
            count = docs if self.packing == "padded" else (length - 1) // self.seq_len
            if count >= limit:
                count = limit
                break
        self.num_sequences = count
        self.num_tokens = length
        return count

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        if start != self.position:
            raise RuntimeError(
                f"HFSource is sequential: asked for sequence {start}, at {self.position}"
            )
        T = self.seq_len
        if self.packing == "padded":
            inputs = np.full((count, T), EOT_ID, dtype=np.int64)
            labels = np.full((count, T), IGNORE_INDEX, dtype=np.int64)
            for j in range(count):
                _pad_row(self._next_doc(), inputs[j], labels[j])
            self.position += count
            return inputs, labels
        if self._pending is not None:
            self._restore(self._pending)
        seqs = np.empty((count, T + 1), dtype=np.int64)
        doc, offset = self._doc, self._offset
        for row in seqs:
            filled = 0
            while True:  # copy T + 1 tokens, from the next documents where this one ends
                n = min(len(doc) - offset, T + 1 - filled)
                row[filled : filled + n] = doc[offset : offset + n]
                filled, offset = filled + n, offset + n
                if filled == T + 1:
                    break
                doc, offset = self._with_bos(self._next_doc()), 0
            offset -= 1  # the last label is the next sequence's first input
        if doc is not self._doc:  # a document read from the dataset
            self._doc_is_row = True
        self._doc, self._offset = doc, offset
        self.position += count
        return seqs[:, :T].copy(), seqs[:, 1:].copy()

    @staticmethod
    def _with_bos(ids: np.ndarray) -> np.ndarray:
        out = np.empty(len(ids) + 1, dtype=np.int64)
        out[0] = EOT_ID
        out[1:] = ids
        return out

    def _restore(self, state: dict[str, Any]) -> None:
        """Read again the document a loaded ``state`` stopped in (row ``docs_consumed - 1``)
        and go to the saved offset in it; a state of the old format holds the carry itself,
        which is that document's end."""
        self._pending = None
        saved, per_epoch = self.docs_consumed, self.docs_per_epoch
        self.docs_consumed -= 1
        self._it = None
        doc = self._with_bos(self._next_doc())
        same_row = self.docs_consumed == saved  # else that row is empty now: data changed
        carry = state.get("buffer")
        if carry is None:
            offset = int(state["offset"])
            if not same_row or offset >= len(doc):
                held = "holds" if same_row else "is empty; the next non-empty row holds"
                raise ValueError(
                    f"cannot resume the HF dataset: the checkpoint stopped at token {offset} "
                    f"of row {saved - 1} (BOS included), which now {held} {len(doc)} tokens: "
                    "the dataset changed since the checkpoint was written. Resume with the "
                    "data it was trained on"
                )
            self._doc, self._offset, self._doc_is_row = doc, offset, True
            return
        carry = np.asarray(carry, dtype=np.int64)
        start = len(doc) - len(carry)
        if same_row and start >= 0 and np.array_equal(doc[start:], carry):
            self._doc, self._offset, self._doc_is_row = doc, start, True
            return
        # not that document's end (the data changed since): go on from the saved tokens
        # and documents, as the old format did
        self.docs_consumed, self.docs_per_epoch, self._it = saved, per_epoch, None
        self._doc, self._offset, self._doc_is_row = carry, 0, False

    def state_dict(self) -> dict[str, Any]:
        """Position, documents consumed (over all epochs) and ``docs_per_epoch`` (once
        known); packed, ``offset``: where the next sequence starts in the BOS and tokens of
        the last document consumed (``None``: nothing carried over)."""
        if self._pending is not None:
            return dict(self._pending)
        state = {
            "position": self.position,
            "docs_consumed": self.docs_consumed,
            "docs_per_epoch": self.docs_per_epoch,
        }
        if not self._doc_is_row:  # a carry that is no document's end: saved as is
            return {**state, "buffer": self._doc[self._offset :].tolist()}
        carried = self._offset < len(self._doc)
        return {**state, "offset": self._offset if carried else None}

    def reset(self) -> None:
        """Go back to the first sequence of the first epoch."""
        self.load_state_dict(
            {"position": 0, "docs_consumed": 0, "docs_per_epoch": None, "offset": None}
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, or a state of the old format (``buffer``: the
        carried-over tokens). The document it stopped in is read again at the next read."""
        self.position = int(state["position"])
        self.docs_consumed = int(state["docs_consumed"])
        self.docs_per_epoch = state["docs_per_epoch"]
        self._doc = np.zeros(0, dtype=np.int64)
        self._offset = 0
        self._doc_is_row = True
        buffer = state.get("buffer")
        carried = state.get("offset") is not None or (buffer is not None and len(buffer) > 0)
        self._pending = dict(state) if carried else None
        self._it = None


def _no_documents(rows: int) -> str:
    if rows == 0:
        return "the HF dataset has no documents (no rows)"
    return (
        f"the HF dataset has no documents: all {rows} rows have empty text (or none); check "
        "the files, or set data.text_field to the column that holds the text"
    )


# --------------------------------------------------------------------------------------------
# batching and sharding
# --------------------------------------------------------------------------------------------


def make_batch(
    inputs: np.ndarray, labels: np.ndarray, *, varlen: bool, doc_start_id: int = EOT_ID
) -> Batch:
    """Turn ``[B, T]`` numpy sequences into a :class:`Batch`.

    With ``varlen`` the rows are laid end to end (``B == 1``) and ``cu_seqlens`` marks a
    boundary at every row start and every position holding ``doc_start_id`` (EOT, the BOS
    fot puts before each document; another tokenizer's BOS in its flat token files), so
    attention never crosses a document.
    """
    B, T = inputs.shape
    if not varlen:
        return Batch(torch.from_numpy(inputs), torch.from_numpy(labels), None, T)
    flat = inputs.reshape(-1)
    starts = flat == doc_start_id
    starts[::T] = True  # every row starts a segment
    bounds = np.append(np.flatnonzero(starts), B * T).astype(np.int32)
    return Batch(
        torch.from_numpy(flat.reshape(1, -1)),
        torch.from_numpy(labels.reshape(1, -1)),
        torch.from_numpy(bounds),
        T,
    )


def check_token_ids(batches: Sequence[Batch], vocab_size: int, *, what: str) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` before they reach the embedding.

    There they would fail as an index error deep inside the model (on CUDA, as a device-side
    assert that kills the process). Token files written by another tokenizer are the usual
    cause. The check reads the CPU batches (``[B, T]`` int64): microseconds per step.

    Args:
        batches: micro batches of one step (on the CPU), labels ``-100`` where ignored.
        vocab_size: the model's vocabulary size.
        what: the data they come from, for the message (``training data`` / ``held-out data``).

    Raises:
        ValueError: naming the bad id, the vocabulary size and the fixes.
    """
    bad = first_bad_token_id(batches, vocab_size)
    if bad is not None:
        raise token_id_error(bad, vocab_size, what=what)


def first_bad_token_id(batches: Sequence[Batch], vocab_size: int) -> int | None:
    """The first token id of ``batches`` (CPU micro batches, labels ``-100`` where ignored)
    outside ``[0, vocab_size)``: the smallest if one is negative, else the largest; ``None``
    if all are inside."""
    for b in batches:
        # labels hold the inputs' tokens plus one more per row (-100 where ignored), which
        # no input holds in a zarr chunk or in the last sequence of a rank's share
        labels = b.labels.masked_fill(b.labels == IGNORE_INDEX, 0)
        lo = min(int(b.input_ids.min()), int(labels.min()))
        hi = max(int(b.input_ids.max()), int(labels.max()))
        if lo < 0 or hi >= vocab_size:
            return lo if lo < 0 else hi
    return None


def token_id_error(bad: int, vocab_size: int, *, what: str) -> ValueError:
    """The error for token id ``bad`` of ``what`` (``training data``, ...) outside
    ``[0, vocab_size)``, with the fixes."""
    # the first id outside seen, not the largest: vocab_size=bad+1 can stop at a later step
    larger = (
        ", or give the model the vocabulary of the tokenizer that made it "
        "(++model.overrides={vocab_size:<that tokenizer's vocabulary size>}, which is more "
        f"than {bad}; ids above {bad} may follow)"
        if bad > 0
        else ""
    )
    return ValueError(
        f"the {what} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}): "
        "it was tokenized with another tokenizer, or is not a token file. Re-tokenize it with "
        f"`python -m fot.data.prepare` (GPT-2 BPE){larger}"
    )


def clamp_token_ids(batch: Batch, vocab_size: int) -> Batch:
    """A copy of ``batch`` with its token ids clamped into ``[0, vocab_size)`` (ignored labels
    stay ``-100``): what a rank computes on while the error for its bad ids waits for the
    other ranks (``fot.training.trainer``)."""
    ignored = batch.labels == IGNORE_INDEX
    return Batch(
        batch.input_ids.clamp(0, vocab_size - 1),
        batch.labels.clamp(0, vocab_size - 1).masked_fill(ignored, IGNORE_INDEX),
        batch.cu_seqlens,
        batch.seq_len,
    )


class SequenceStream:
    """Per-rank batches of a :class:`SequenceSource`, with an exact, resumable position.

    Each :meth:`next_step` consumes one global batch of ``global_batch_size`` sequences.
    Rank ``r`` of ``W`` takes the contiguous block ``[r * S / W, (r+1) * S / W)`` of it and cuts
    that into ``accum`` micro batches of ``micro_batch_size`` sequences.

    Args:
        source: the sequence source.
        global_batch_size: sequences per optimizer step over all ranks (S).
        micro_batch_size: sequences per forward pass on one rank.
        rank: this process' rank.
        world_size: number of ranks (W); ``S`` must be divisible by ``W * micro_batch_size``.
    """

    def __init__(
        self,
        source: SequenceSource,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if micro_batch_size < 1 or global_batch_size < 1:
            raise ValueError(
                f"batch sizes must be >= 1, got global {global_batch_size}, micro {micro_batch_size}"
            )
        if global_batch_size % (world_size * micro_batch_size):
            raise ValueError(
                f"the global batch of {global_batch_size} sequences cannot be split into "
                f"{world_size} ranks x micro batches of {micro_batch_size} sequences; choose "
                "sizes so that global_batch_tokens / seq_len is a multiple of "
                f"world_size * micro_batch_size = {world_size * micro_batch_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.source = source
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.local_batch_size = global_batch_size // world_size
        self.accum_steps = self.local_batch_size // micro_batch_size
        self.position = 0
        self.varlen = bool(getattr(source, "varlen", False))
        self.doc_start_id = int(getattr(source, "doc_start_id", EOT_ID))

    def next_step(self) -> list[Batch]:
        """The micro batches of this rank for the next optimizer step."""
        S, local, m = self.global_batch_size, self.local_batch_size, self.micro_batch_size
        if self.source.sequential:
            inputs, labels = self.source.read(self.position, S)
            lo = self.rank * local
            inputs, labels = inputs[lo : lo + local], labels[lo : lo + local]
        else:
            inputs, labels = self.source.read(self.position + self.rank * local, local)
            prefetch = getattr(self.source, "prefetch", None)
            if prefetch is not None:  # the next step's sequences, read while this one runs
                prefetch(self.position + S + self.rank * local, local)
        self.position += S
        return [
            make_batch(
                inputs[a : a + m],
                labels[a : a + m],
                varlen=self.varlen,
                doc_start_id=self.doc_start_id,
            )
            for a in range(0, local, m)
        ]

    def last_step_digest(self, *, with_labels: bool = True) -> str | None:
        """SHA-256 (hex) of the token ids of the last global batch, re-read from the source.

        The same for any world size and micro-batch size. Recorded in checkpoints so that a
        resumed run can tell whether the data at its position changed (e.g. a token folder
        rewritten by ``fot.data.prepare``). ``None`` before the first step and for a sequential
        source (HF datasets), which reads only onwards from where it is.

        Args:
            with_labels: hash the labels after the inputs (every token the step read: a zarr
                chunk's last token is only a label). ``False`` hashes the inputs alone, as
                checkpoints' ``data_digest`` did before (compared on resume from those).
        """
        if self.source.sequential or self.position < self.global_batch_size:
            return None
        inputs, labels = self.source.read(
            self.position - self.global_batch_size, self.global_batch_size
        )
        digest = hashlib.sha256(np.ascontiguousarray(inputs, dtype=np.int64).tobytes())
        if with_labels:
            digest.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
        return digest.hexdigest()

    def state_dict(self) -> dict[str, Any]:
        """Position (sequences consumed) and the source's own state; the same on every rank."""
        return {"position": self.position, "source": self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.position = int(state["position"])
        self.source.load_state_dict(state["source"])


def iterate_eval_batches(
    source: SequenceSource,
    *,
    num_sequences: int,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[Batch]:
    """The first ``num_sequences`` sequences of ``source``, this rank's share, in micro batches.

    Rank ``r`` takes the contiguous block ``[r * n, (r+1) * n)`` with ``n = ceil(N / W)`` (the
    last rank may get fewer, or none). Sequential sources are reset and read from the start.
    """
    per = math.ceil(num_sequences / world_size)
    lo, hi = min(rank * per, num_sequences), min((rank + 1) * per, num_sequences)
    varlen = bool(getattr(source, "varlen", False))
    start = int(getattr(source, "doc_start_id", EOT_ID))
    if source.sequential:
        source.reset()  # type: ignore[attr-defined]
        inputs, labels = source.read(0, hi)
        for a in range(lo, hi, micro_batch_size):
            b = min(a + micro_batch_size, hi)
            yield make_batch(inputs[a:b], labels[a:b], varlen=varlen, doc_start_id=start)
        return
    prefetch = getattr(source, "prefetch", None)
    for a in range(lo, hi, micro_batch_size):
        inputs, labels = source.read(a, min(micro_batch_size, hi - a))
        b = a + micro_batch_size
        if prefetch is not None and b < hi:
            prefetch(b, min(micro_batch_size, hi - b))
        yield make_batch(inputs, labels, varlen=varlen, doc_start_id=start)
