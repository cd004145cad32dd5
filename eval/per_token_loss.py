"""Per-token loss L(i), validation perplexity P(l) and horizon averages (paper Fig. 2).

For every held-out document with at least ``length`` tokens the model reads its first
``length`` tokens once; ``L[j]`` is the mean cross-entropy (nats) of predicting the token at
position ``j + 1`` from the ``j + 1`` tokens before it (with ``prepend_bos``, a BOS token is put
in front and ``L[j]`` predicts token ``j`` from BOS plus the ``j`` tokens before it). From it:

* horizon average ``A(h) = mean(L[:h])`` (loss of the first h predictions), and
* ``P(l) = exp(A(l))``: perplexity of a sequence of length l (for a causal model, evaluating at
  length l is the same as truncating the length-``length`` evaluation at l).

Data sources: a LongCrawl64-style zarr array (one document per row) on a disk or behind a URL
(``gs://<bucket>/heldout.zarr``; :class:`ZarrDocuments` reads it in whole chunks), a token
folder (:class:`fot.data.tokens.TokenDocuments`) or ``sample`` (the offline held-out sample
corpus).

Under ``torchrun`` every rank reads every ``world_size``-th document and the sums are
all-reduced. Resume: each process saves its running sums and finished document ids every few
documents (``state.npz`` in one process, ``state_rank{r}.npz`` under torchrun) and continues
from there after an interruption, with any number of processes: saved states that this run's
processes do not continue are first folded into rank 0's (:func:`fold_foreign_states`), and the
documents no state has finished are shared out again. ``per_token_loss.resume.json`` records the
checkpoint and settings these sums belong to (:func:`fot.eval.common.claim_results`), so other
ones are refused instead of mixed in.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import operator
import os
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fot.errors import MissingPackageError
from fot.interrupt import check_stop
from fot.progress import progress_bar
from fot.training.checkpoint import write_text_atomic, written_whole
from fot.training.parallel import (
    TORCH_DEFAULT_TIMEOUTS,
    CollectiveTimeoutError,
    is_collective_timeout,
    stop_together,
)

from .common import (
    CHECKPOINT_HELP,
    CONTEXT_LENGTH_HELP,
    add_label_argument,
    add_run_arguments,
    add_storage_options_argument,
    add_train_length_argument,
    check_out_shared,
    check_positions,
    check_token_ids,
    claim_results,
    context_length_key,
    eot_id,
    length_option,
    load_checkpoint,
    load_npz,
    lock_out,
    model_dtype,
    model_max_length,
    path_setting,
    pick_device,
    plot_label,
    positive_int,
    save_figure,
    token_losses,
    train_length_option,
    use_agg_backend,
    vocab_size,
    write_run_config,
    zarr_url_fingerprint,
)


class PerTokenLossAccumulator:
    """Running sums of per-position losses; ``mean()`` is L(i).

    Sums are kept in float64 on the CPU so the order of documents does not change results.

    Args:
        length: number of positions ``n`` (losses are ``[B, n]``).
    """

    def __init__(self, length: int) -> None:
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        self.length = length
        self.loss_sum = np.zeros(length, dtype=np.float64)
        self.count = np.zeros(length, dtype=np.int64)

    def update(
        self, losses: torch.Tensor | np.ndarray, mask: torch.Tensor | np.ndarray | None = None
    ) -> None:
        """Add a batch of losses ``[B, n]`` (float); ``mask`` ``[B, n]`` bool marks valid ones."""
        arr = (
            losses.detach().double().cpu().numpy()
            if torch.is_tensor(losses)
            else np.asarray(losses, dtype=np.float64)
        )
        if arr.ndim != 2 or arr.shape[1] != self.length:
            raise ValueError(f"losses must be [B, {self.length}], got {list(arr.shape)}")
        if not np.isfinite(arr).all():
            raise ValueError("losses contain NaN or inf: the model output is broken")
        if mask is None:
            self.loss_sum += arr.sum(0)
            self.count += arr.shape[0]
        else:
            m = mask.cpu().numpy() if torch.is_tensor(mask) else np.asarray(mask)
            self.loss_sum += np.where(m, arr, 0.0).sum(0)
            self.count += m.sum(0).astype(np.int64)

    def all_reduce(self) -> None:
        """Sum the accumulators of all ranks (no-op without an initialised process group)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        backend = torch.distributed.get_backend()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        s = torch.from_numpy(self.loss_sum).to(device)
        c = torch.from_numpy(self.count).to(device)
        torch.distributed.all_reduce(s)
        torch.distributed.all_reduce(c)
        self.loss_sum = s.cpu().numpy()
        self.count = c.cpu().numpy()

    def mean(self) -> np.ndarray:
        """``[n]`` float64 mean loss per position (NaN where nothing was counted)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.loss_sum / self.count

    def horizon_average(self, horizons: Sequence[int]) -> dict[int, float]:
        """Loss averaged over the first ``h`` positions, for each ``h`` (token-weighted)."""
        cs, cc = np.cumsum(self.loss_sum), np.cumsum(self.count)
        out = {}
        for h in horizons:
            if not 1 <= h <= self.length:
                raise ValueError(f"horizon {h} outside [1, {self.length}]")
            out[int(h)] = float(cs[h - 1] / cc[h - 1]) if cc[h - 1] else float("nan")
        return out

    def state(self) -> dict[str, np.ndarray]:
        """The running sums (float64 ``loss_sum`` and int64 ``count``, ``[length]`` each)."""
        return {"loss_sum": self.loss_sum, "count": self.count}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Continue from :meth:`state` of an earlier run of the same ``length``."""
        if state["loss_sum"].shape != (self.length,):
            raise ValueError(
                f"saved state has {state['loss_sum'].shape[0]} positions, this run "
                f"{self.length}: use a fresh --out folder or the same --length"
            )
        self.loss_sum = np.array(state["loss_sum"], dtype=np.float64)
        self.count = np.array(state["count"], dtype=np.int64)


def default_horizons(n: int) -> list[int]:
    """Powers of two from 16 up to ``n``, plus ``n`` itself."""
    hs = [h for h in (2**k for k in range(4, 40)) if h < n]
    return [*hs, n]


# --------------------------------------------------------------------------------------------
# data


class ZarrDocuments:
    """The rows of a 2-D zarr token array (LongCrawl64 ``heldout.zarr``) as documents, read
    in whole chunks through a :class:`fot.data.zarr_store.ChunkReader`.

    zarr reads whole chunks, and a chunk holds many rows: reading the rows one after another
    from the array itself would fetch and decode each chunk once per row it holds (over a URL,
    that many downloads). The reader keeps the chunks it read in a bounded cache, so a pass
    over the rows fetches each chunk once; :meth:`prefetch` fetches the next rows' chunks in
    the background. Reads from a URL are retried (:data:`fot.data.loaders.URL_READ_RETRIES`).

    Args:
        array: the ``[documents, tokens]`` zarr array.
        name: its path or URL, for messages.
        url: whether it is behind a URL.
        storage_options: the options of the URL's filesystem it was opened with.
    """

    def __init__(
        self,
        array: Any,
        *,
        name: str,
        url: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        from fot.data.loaders import URL_READ_RETRIES
        from fot.data.zarr_store import ChunkReader, cache_bytes_for, chunk_checker

        self.array = array
        self.shape = tuple(int(n) for n in array.shape)
        self.dtype = np.dtype(array.dtype)
        self.name, self.url, self.storage_options = name, url, storage_options
        self.reader = ChunkReader(
            array,
            retries=URL_READ_RETRIES if url else 0,
            name=name,
            chunk_exists=chunk_checker(array, name, storage_options) if url else None,
        )
        # room for four chunk rows across whole rows (within 4 GiB; larger are read uncached)
        self.reader.cache_bytes = cache_bytes_for(self.reader, [(0, self.shape[1])])

    def __len__(self) -> int:
        return self.shape[0]

    def _row(self, i: int) -> int:
        i = operator.index(i)
        if not -self.shape[0] <= i < self.shape[0]:
            raise IndexError(f"document {i} of {self.shape[0]} in {self.name}")
        return i % self.shape[0]

    def head(self, i: int, n: int) -> np.ndarray:
        """The first ``n`` tokens of document ``i`` (all of them if it has fewer)."""
        i, n = self._row(i), min(n, self.shape[1])
        if n <= 0:
            return np.zeros(0, self.dtype)
        try:
            return np.array(self.reader.read(i, i + 1, 0, n)[0])  # a copy, not the cache's
        except ConnectionError as err:  # the reader gave up after its retries
            if not self.url:
                raise
            cause = err.__cause__ or err
            raise ConnectionError(
                f"could not read document {i} of {self.name} after "
                f"{self.reader.retries + 1} attempts ({type(cause).__name__}: {cause}); check "
                "the network and the credentials (--storage-options), then rerun the same "
                "command: it resumes from the results saved in --out"
            ) from err

    def __getitem__(self, i: int) -> np.ndarray:
        """Document ``i``: a whole row, as a 1-D integer array."""
        return self.head(i, self.shape[1])

    def prefetch(self, ids: Sequence[int], n: int) -> None:
        """Start fetching the chunks of the first ``n`` tokens of documents ``ids`` in the
        background (the next batch's, while the model runs this one)."""
        n = min(n, self.shape[1])
        from fot.data.zarr_store import consecutive_runs

        for lo, hi in consecutive_runs(sorted({self._row(i) for i in ids})):
            if n > 0:
                self.reader.prefetch(lo, hi, 0, n)

    def fingerprint(self) -> str | None:
        """A fingerprint of the array behind a URL for resume records
        (:func:`fot.eval.common.zarr_url_fingerprint`); ``None`` for a local array, which
        :func:`fot.eval.common.claim_results` fingerprints by its files."""
        if not self.url:
            return None
        return zarr_url_fingerprint(self.name, self.array, self.storage_options)


def url_fingerprints(option: str, docs: Any) -> dict[str, str]:
    """``{option: fingerprint}`` of documents read from a URL, for
    :func:`fot.eval.common.claim_results`; empty for other sources."""
    fingerprint = docs.fingerprint() if isinstance(docs, ZarrDocuments) else None
    return {option: fingerprint} if fingerprint else {}


def open_documents(
    source: str, storage_options: dict[str, Any] | None = None
) -> tuple[Sequence[np.ndarray], str]:
    """Open a held-out document source.

    Args:
        source: ``"sample"`` (held-out split of the offline sample corpus), a zarr array folder
            (LongCrawl64 ``heldout.zarr``: rows of token ids), a token folder, or the fsspec
            URL of a zarr array (``gs://<bucket>/heldout.zarr``, ``s3://...``, ``https://...``).
        storage_options: options of a URL's filesystem (credentials); only with a URL.

    Returns:
        ``(documents, kind)`` with ``kind`` in ``{"sample", "zarr", "tokens"}``; documents
        support ``len()`` and ``[i]`` giving 1-D integer arrays; a zarr array's are a
        :class:`ZarrDocuments` (also ``.shape``, ``head``, ``prefetch``).

    Raises:
        FileNotFoundError: nothing at ``source`` (for a URL: no zarr array there).
        ValueError: not a source of token ids (unreadable, a group, not 2-D, not integers).
        MissingPackageError: a URL whose filesystem package (gcsfs, s3fs) is not installed.
        ConnectionError: a URL whose server or bucket cannot be reached.
    """
    from fot.data.zarr_store import is_url, join, open_zarr_array, zarr_exists

    url = is_url(source)
    if storage_options is not None and not url:
        raise ValueError(
            f"--storage-options goes to the filesystem of a URL --data, but --data {source!r} "
            "is not a URL; leave --storage-options out"
        )
    if source == "sample":
        from fot.data.sample import sample_documents

        return sample_documents("heldout"), "sample"
    if url:
        source = source.rstrip("/")
        try:
            found = zarr_exists(source, storage_options)
            elsewhere = not found and zarr_exists(join(source, "heldout.zarr"), storage_options)
        except ImportError as err:  # gs:// without gcsfs: the package is named
            raise MissingPackageError(f"--data {source!r}: {err}") from None
        except OSError as err:  # unreachable: zarr_exists names the URL and what to check
            raise ConnectionError(f"--data {source!r}: {err}") from None
        except ValueError as err:  # a protocol fsspec does not know
            raise ValueError(f"--data {source!r}: {err}") from None
        if not found:
            hint = (
                f"{join(source, 'heldout.zarr')} does: pass --data {join(source, 'heldout.zarr')}"
                if elsewhere
                else "check the URL (LongCrawl64's held-out rows are <its folder's "
                "URL>/heldout.zarr), that the server or bucket can be reached, and "
                "the credentials (--storage-options); only zarr arrays are read from a URL (copy "
                "a token folder to a local disk and pass its path)"
            )
            raise FileNotFoundError(
                f"--data {source!r} holds no zarr array (no zarr.json or .zarray there): {hint}"
            )
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(
                f"--data {source!r} does not exist; pass 'sample', a zarr array "
                "(e.g. LongCrawl64 heldout.zarr, or its URL gs://<bucket>/heldout.zarr) or a "
                "token folder"
            )
        if (path / "meta.json").is_file():
            from fot.data.tokens import TokenDocuments

            return TokenDocuments(path), "tokens"
        from fot.data.tokens import FILES, is_token_folder

        if path.name in FILES and is_token_folder(path.parent):
            raise ValueError(
                f"--data {source!r} is a file of the token folder {path.parent}, which is read "
                f"whole: pass --data {path.parent}"
            )
        if not (
            path.suffix == ".zarr" or (path / "zarr.json").is_file() or (path / ".zarray").is_file()
        ):
            out = f"{path.name.removesuffix(path.suffix) or 'data'}_tokens"
            raise ValueError(
                f"--data {source!r} is neither a token folder (meta.json) nor a zarr array; "
                "text (.txt files, .jsonl) is tokenized into a token folder first: python -m "
                f"fot.data.prepare {source} --out {out}, then pass --data {out}"
            )
    try:
        arr = open_zarr_array(source, storage_options=storage_options)
    except ValueError as err:  # unreadable metadata, a group: named with the fix
        raise ValueError(f"--data {source!r}: {err}") from None
    except OSError as err:  # the metadata could not be read from the URL
        raise ConnectionError(f"--data {source!r}: {err}") from None
    if len(arr.shape) != 2:
        raise ValueError(f"zarr at {source!r} must be a 2-D array (documents x tokens)")
    if not np.issubdtype(np.dtype(arr.dtype), np.integer):
        raise ValueError(
            f"--data {source!r} holds {arr.dtype} values, not token ids: pass a zarr array "
            "of integer token ids (LongCrawl64 heldout.zarr is uint16)"
        )
    return ZarrDocuments(arr, name=source, url=url, storage_options=storage_options), "zarr"


def num_documents(docs: Sequence[np.ndarray]) -> int:
    """Number of documents (rows of a zarr array, entries of a list or token folder)."""
    shape = getattr(docs, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 2 else len(docs)


def documents_for(docs: Sequence[np.ndarray], kind: str, tokenizer: Any) -> Sequence[np.ndarray]:
    """``docs`` as the model of ``tokenizer`` reads them: the sample corpus (``kind``
    ``"sample"``) is tokenized again from its texts escaped as the model's training texts were
    (``fot.tokenizer.text_escaping_of``: JSON for LongCrawl64 models). Token data (zarr, token
    folders) is the model's own tokens already and is returned as it is."""
    from fot.tokenizer import text_escaping_of

    escaping = text_escaping_of(tokenizer)
    if kind != "sample" or escaping == "none":
        return docs
    from fot.data.sample import sample_documents

    return sample_documents("heldout", escaping)


def escaping_setting(kind: str, tokenizer: Any) -> dict[str, str]:
    """The resume setting that :func:`documents_for`'s escaping adds (``{}`` when it escapes
    nothing): results on the sample corpus saved before it was escaped for the model (fot
    before this setting) do not resume as if they were of the same tokens."""
    from fot.tokenizer import text_escaping_of

    escaping = text_escaping_of(tokenizer)
    return {"sample text escaping": escaping} if kind == "sample" and escaping != "none" else {}


def eligible_documents(
    docs: Sequence[np.ndarray], kind: str, min_tokens: int, max_docs: int | None
) -> list[int]:
    """Indices of the first ``max_docs`` documents with at least ``min_tokens`` tokens."""
    if kind == "zarr":
        n = num_documents(docs) if int(docs.shape[1]) >= min_tokens else 0  # type: ignore[attr-defined]
        idx = list(range(n))
    elif hasattr(docs, "lengths"):
        idx = np.flatnonzero(docs.lengths() >= min_tokens).tolist()  # type: ignore[attr-defined]
    else:
        idx = [i for i in range(len(docs)) if len(docs[i]) >= min_tokens]
    return idx[:max_docs] if max_docs else idx


# --------------------------------------------------------------------------------------------
# evaluation


def _dist_info(timeout_s: int | None = None) -> tuple[int, int]:
    """``(rank, world size)``; under torchrun (``WORLD_SIZE`` > 1) the process group is made
    first, with ``timeout_s`` (``--timeout-s``; ``None``: torch's defaults)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and torch.distributed.is_available() and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        torch.distributed.init_process_group(backend, **timeout)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@contextlib.contextmanager
def naming_timeouts(timeout_s: int | None, out: Path) -> Iterator[None]:
    """Raise a collective's timeout inside the block (this process waited longer than
    ``--timeout-s`` for the others) as one line naming the option and what is saved in
    ``out``; any other error as it is."""
    try:
        yield
    except RuntimeError as err:
        if not is_collective_timeout(err):
            raise
        limit = (
            f"torch's default timeout ({TORCH_DEFAULT_TIMEOUTS})"
            if timeout_s is None
            else f"--timeout-s {timeout_s}"
        )
        raise CollectiveTimeoutError(
            f"waited longer than {limit} for the other processes, and one of them did not "
            "come: it stalled or died (see its output), or was busy that long on its own "
            "(slower reads of --data, a slower GPU): then raise --timeout-s. Finished documents "
            f"are saved in {str(out)!r}: rerun the same command to resume"
        ) from err


def evaluate_per_token_loss(
    model: torch.nn.Module,
    docs: Sequence[np.ndarray],
    doc_ids: Sequence[int],
    *,
    length: int,
    batch_size: int = 1,
    bos_id: int | None = None,
    device: torch.device | None = None,
    state_path: Path | None = None,
    save_every: int = 8,
    progress: bool = True,
    processes: int = 1,
    source: str = "the data",
) -> tuple[PerTokenLossAccumulator, list[int]]:
    """Accumulate L(i) over documents (this rank's share; call ``all_reduce`` afterwards).

    Args:
        model: causal LM (see :func:`fot.eval.common.token_losses`).
        docs: documents (``docs[i]`` is a 1-D int array).
        doc_ids: which documents to read (each has at least ``length`` tokens).
        length: tokens read per document (without BOS).
        batch_size: documents per forward pass.
        bos_id: if given, this token is put in front of every document.
        state_path: ``.npz`` file for resuming (sums and finished ids), or None.
        save_every: documents between two state saves.
        progress: show a progress bar.
        processes: processes the documents are split over: the bar says that it counts this
            process's share.
        source: where ``docs`` come from, for errors (e.g. ``"--data 'heldout.zarr'"``).

    Returns:
        ``(accumulator, finished_doc_ids)``; the accumulator has ``length`` positions with BOS,
        ``length - 1`` without.
    """
    device = device or next(model.parameters()).device
    vocab = vocab_size(model)
    n = length if bos_id is not None else length - 1
    acc = PerTokenLossAccumulator(n)
    done: list[int] = []
    if state_path is not None and state_path.is_file():
        saved = load_npz(state_path, ("loss_sum", "count", "done"), _STATE_FIX)
        acc.load_state(saved)
        done = saved["done"].astype(np.int64).tolist()
    finished = set(done)
    todo = [i for i in doc_ids if i not in finished]
    since_save = 0

    def save() -> None:
        if state_path is None:
            return
        with written_whole(state_path) as tmp:
            np.savez(tmp, **acc.state(), done=np.asarray(done, dtype=np.int64))

    bar = progress_bar(
        total=len(doc_ids),
        initial=len(doc_ids) - len(todo),
        disable=not progress,
        desc=f"per-token loss @ {length}"
        + (f" (this process's documents; {processes} processes)" if processes > 1 else ""),
        unit="doc",
    )
    consistent = True  # acc and done hold the same documents (False only while updating both)
    head = getattr(docs, "head", None)  # ZarrDocuments: only the columns read, chunk-cached
    prefetch = getattr(docs, "prefetch", None)
    try:
        for s in range(0, len(todo), batch_size):
            ids = todo[s : s + batch_size]
            if head is not None:
                rows = np.stack([head(i, length) for i in ids])
            else:
                rows = np.stack([np.asarray(docs[i][:length]) for i in ids])
            if prefetch is not None and s + batch_size < len(todo):
                prefetch(todo[s + batch_size : s + 2 * batch_size], length)  # while this runs
            what = f"{source} (document{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))})"
            if not np.issubdtype(rows.dtype, np.integer):
                raise ValueError(f"{what} holds {rows.dtype} values, not token ids")
            check_token_ids(rows, vocab, what)
            rows = rows.astype(np.int64)
            tokens = torch.from_numpy(rows).to(device)  # (B, length)
            if bos_id is not None:
                bos = torch.full((tokens.shape[0], 1), bos_id, dtype=torch.long, device=device)
                inputs, labels = torch.cat([bos, tokens[:, :-1]], 1), tokens  # (B, length)
            else:
                inputs, labels = tokens[:, :-1], tokens[:, 1:]  # (B, length - 1)
            check_stop()  # a SIGTERM whose first raise was lost (inside a __del__) stops here
            losses = token_losses(model, inputs, labels)
            consistent = False
            acc.update(losses)
            done.extend(ids)
            consistent = True
            since_save += len(ids)
            bar.update(len(ids))
            if since_save >= save_every:
                save()
                since_save = 0
    finally:
        # also on Ctrl-C or an error: the documents finished since the last save are kept
        bar.close()
        if since_save and consistent:
            save()
    return acc, done


def state_file(out: Path, rank: int, world: int) -> Path:
    """The resume file of process ``rank`` of ``world``: ``state.npz`` in one process,
    ``state_rank{rank}.npz`` under torchrun."""
    return out / "state.npz" if world == 1 else out / f"state_rank{rank}.npz"


def _saved_states(out: Path) -> list[Path]:
    # ``state.tmp.npz``: a temporary file that a run of an earlier version left when stopped
    return sorted(p for p in out.glob("state*.npz") if not p.name.endswith(".tmp.npz"))


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{path.name}:{st.st_size}:{st.st_mtime_ns}"


_STATE_FIX = (
    "it holds the sums of an interrupted run: pass --restart (moves the earlier results to "
    "--out/superseded/ and starts over) or choose another --out"
)


def fold_foreign_states(out: Path, world: int) -> list[str]:
    """Fold saved states that no process of this run continues into rank 0's (rank 0 only).

    A run resumed with another number of processes finds files of the earlier layout
    (``state_rank3.npz`` when two processes run now, ``state.npz`` under torchrun): their
    sums and finished documents are added to rank 0's file, which records the folded files
    (name, size, modification time) before they are deleted, so that files a crash left
    behind are recognised and not counted twice. The records of every saved state are read,
    not only this run's rank 0's: a fold into ``state_rank0.npz`` that a crash cut short,
    rerun in one process, finds the folded ``state.npz`` listed in ``state_rank0.npz``.

    Returns:
        The names of the folded files.
    """
    target = state_file(out, 0, world)
    # finish a fold that a crash interrupted, whichever layout it folded into
    folded: set[str] = set()
    for p in _saved_states(out):
        try:
            with np.load(p) as saved:
                if "folded" in saved.files:
                    folded |= set(saved["folded"].tolist())
        except (zipfile.BadZipFile, EOFError, OSError, ValueError):
            pass  # damaged: named with the fix where the state is read
    for p in _saved_states(out):
        if _stamp(p) in folded:
            p.unlink()
    own = {state_file(out, r, world) for r in range(world)}
    foreign = [p for p in _saved_states(out) if p not in own]
    if not foreign:
        return []
    parts = [load_npz(p, ("loss_sum", "count", "done"), _STATE_FIX) for p in foreign]
    if target.is_file():
        parts.append(load_npz(target, ("loss_sum", "count", "done"), _STATE_FIX))
    if len({part["loss_sum"].shape for part in parts}) > 1:
        raise ValueError(
            f"the saved states in {str(out)!r} ({', '.join(p.name for p in foreign)}) hold "
            f"different numbers of positions; {_STATE_FIX}"
        )
    with written_whole(target) as tmp:
        np.savez(
            tmp,
            loss_sum=np.sum([part["loss_sum"] for part in parts], axis=0),
            count=np.sum([part["count"] for part in parts], axis=0),
            done=np.concatenate([part["done"].astype(np.int64) for part in parts]),
            folded=np.asarray([_stamp(p) for p in foreign]),
        )
    for p in foreign:
        p.unlink()
    return [p.name for p in foreign]


def share_of_documents(out: Path, doc_ids: Sequence[int], rank: int, world: int) -> list[int]:
    """The documents process ``rank`` of ``world`` reads: those its saved state finished, and
    every ``world``-th of those that no saved state in ``out`` has finished.

    Call after :func:`fold_foreign_states`, when every saved state is one of this run's.
    """
    mine: set[int] = set()
    finished: set[int] = set()
    for p in _saved_states(out):
        done = set(load_npz(p, ("done",), _STATE_FIX)["done"].astype(np.int64).tolist())
        finished |= done
        if p == state_file(out, rank, world):
            mine = done
    rest = [i for i in doc_ids if i not in finished]
    share = set(rest[rank::world]) | mine
    return [i for i in doc_ids if i in share]


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over ``window`` points (fewer at the start of ``x``)."""
    if window <= 1:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    out = np.empty_like(x, dtype=np.float64)
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    out[:] = (c[idx] - c[lo]) / (idx - lo)
    return out


def plot_per_token_loss(
    runs: dict[str, Path],
    out_file: Path,
    *,
    train_length: int | None = None,
    smooth: int = 101,
) -> Path:
    """Plot L(i) (moving-average smoothed) and P(l) of several runs overlaid (paper Fig. 2).

    Args:
        runs: label -> results folder (holding ``per_token_loss.npz``) or the npz file itself.
        out_file: image path (``.png``/``.pdf``).
        train_length: draw a vertical marker at the training context length.
        smooth: moving-average window in tokens.
    """
    use_agg_backend(out_file)
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    for label, path in runs.items():
        f = Path(path)
        data = np.load(f / "per_token_loss.npz" if f.is_dir() else f)
        pos, loss = data["position"], data["loss"]
        ax_l.plot(pos, moving_average(loss, smooth), label=label, lw=1.2)
        ax_p.plot(data["p_length"], data["perplexity"], marker="o", ms=3, label=label)
    for ax in (ax_l, ax_p):
        if train_length:
            ax.axvline(train_length, color="gray", ls="--", lw=1, label="training length")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ax_l.set_xlabel("token position i")
    ax_l.set_ylabel(f"per-token loss L(i) (moving avg {smooth})")
    ax_p.set_xlabel("validation context length l")
    ax_p.set_ylabel("perplexity P(l)")
    ax_l.legend(fontsize=8)
    return save_figure(fig, out_file)


def write_results(
    acc: PerTokenLossAccumulator,
    out: Path,
    *,
    length: int,
    bos: bool,
    num_docs: int,
    horizons: Sequence[int],
) -> dict[str, Any]:
    """Write ``per_token_loss.npz``, ``horizons.csv`` and ``summary.json``; return the summary."""
    loss = acc.mean()
    hz = acc.horizon_average(horizons)
    # context length of prediction j: j + 1 tokens before it (BOS counted as context).
    position = np.arange(1, acc.length + 1)
    with written_whole(out / "per_token_loss.npz") as tmp:
        np.savez(
            tmp,
            loss=loss,
            count=acc.count,
            position=position,
            p_length=np.asarray(list(hz)),
            perplexity=np.exp(np.asarray(list(hz.values()))),
            horizon_loss=np.asarray(list(hz.values())),
        )
    rows = [f"{h},{v:.6f},{np.exp(v):.6f}\n" for h, v in hz.items()]
    write_text_atomic(out / "horizons.csv", "horizon,mean_loss,perplexity\n" + "".join(rows))
    summary = {
        "length": length,
        "prepend_bos": bos,
        "num_documents": num_docs,
        "positions": acc.length,
        "mean_loss": float(np.nanmean(loss)),
        "horizon_loss": {str(k): v for k, v in hz.items()},
        "perplexity": {str(k): float(np.exp(v)) for k, v in hz.items()},
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def split_overlay(item: str) -> tuple[str, str]:
    """``(label, path)`` of one ``--overlay`` item: ``LABEL=DIR`` or a bare ``DIR``.

    Either side may hold ``=`` (a sweep's folder ``ov/lr=3e-4``, a label of its overrides
    ``model=fot_pro,seed=1``), so the item is split where it names an existing path: the
    whole item if it exists (``label`` empty), else at the first ``=`` whose right side
    exists, else (nothing exists, for the error message) at the first ``=``.
    """
    if "=" not in item or Path(item).exists():
        return "", item
    cuts = [i for i, c in enumerate(item) if c == "="]
    cut = next((i for i in cuts if Path(item[i + 1 :]).exists()), cuts[0])
    return item[:cut], item[cut + 1 :]


def parse_overlays(items: Sequence[str]) -> dict[str, Path]:
    """Parse ``--overlay LABEL=DIR ...`` (or bare ``DIR``, labelled by its folder name); see
    :func:`split_overlay` for a label or folder that holds ``=``.

    Raises:
        FileNotFoundError: a folder holds no ``per_token_loss.npz`` (named, with the fix).
    """
    runs: dict[str, Path] = {}
    fix = (
        "pass LABEL=DIR with DIR the --out folder of a finished per-token-loss run (holding "
        "per_token_loss.npz)"
    )
    for item in items:
        label, path = split_overlay(item)
        p = Path(path)
        npz = p / "per_token_loss.npz" if p.is_dir() else p
        if p.is_file() and p.suffix != ".npz":
            raise NotADirectoryError(f"--overlay {item!r}: {path!r} is a file, not a folder; {fix}")
        if not npz.is_file():
            what = "holds no per_token_loss.npz" if p.is_dir() else "does not exist"
            raise FileNotFoundError(
                f"--overlay {item!r}: {str(p if p.is_dir() else npz)!r} {what}; {fix}"
            )
        load_npz(
            npz,
            ("position", "loss", "p_length", "perplexity"),
            f"--overlay {item!r} cannot be drawn: re-run that per-token-loss evaluation (with "
            "--restart) or leave it out",
        )
        label = label or p.name
        if label in runs:
            raise ValueError(
                f"--overlay {item!r}: the label {label!r} is used twice (one curve would hide "
                "the other); name each run, e.g. --overlay fot=DIR1 transformer=DIR2"
            )
        same = [k for k, q in runs.items() if _results_of(q) == _results_of(p)]
        if same:
            raise ValueError(
                f"--overlay {item!r}: {path!r} is the run of --overlay label {same[0]!r} too "
                "(one run drawn twice, as if two); give each run once"
            )
        runs[label] = p
    return runs


def _results_of(path: Path) -> Path:
    """The ``per_token_loss.npz`` that an ``--overlay`` folder (or the file itself) names, as a
    real path: two spellings of one run compare equal."""
    return (path / "per_token_loss.npz" if path.is_dir() else path).resolve()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``per-token-loss`` command's options."""
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument(
        "--data",
        default="sample",
        help="'sample' (offline held-out corpus), a zarr array such as LongCrawl64 "
        "heldout.zarr or its URL (gs://<bucket>/heldout.zarr; any fsspec URL: s3://, "
        "https://), or a token folder (default: %(default)s)",
    )
    add_storage_options_argument(p)
    p.add_argument(
        "--length",
        type=str,
        default=None,
        help="evaluation length in tokens, e.g. 16k or 65536 (default: "
        f"{CONTEXT_LENGTH_HELP}); only documents at least this long are used",
    )
    p.add_argument(
        "--max-docs",
        type=positive_int,
        default=None,
        help="use at most this many documents (default: every long enough document)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="documents per forward pass (default: %(default)s)",
    )
    p.add_argument(
        "--prepend-bos",
        choices=["yes", "no"],
        default="yes",
        help="put <|endoftext|> before each document (default: %(default)s, as fot's trainer "
        "does for every sequence, zarr rows included)",
    )
    add_train_length_argument(p, "training context length for the plot marker")
    p.add_argument(
        "--smooth",
        type=positive_int,
        default=101,
        help="moving-average window of the plot in tokens (default: %(default)s)",
    )
    p.add_argument(
        "--overlay",
        nargs="*",
        action="extend",  # --overlay A --overlay B draws both, as --overlay A B does
        default=[],
        metavar="LABEL=DIR",
        help="earlier per-token-loss result folders to draw in the same plot (listed after one "
        "--overlay or each after its own); LABEL or DIR may hold '=' (the item is split where "
        "it names an existing path) (default: none)",
    )
    add_label_argument(p, "the plot's legend")
    p.add_argument(
        "--save-every",
        type=positive_int,
        default=8,
        help="documents between resume saves (default: %(default)s)",
    )
    p.add_argument(
        "--timeout-s",
        type=positive_int,
        default=None,
        help="under torchrun: seconds a process waits for the others (at the start, and for "
        "the sums at the end) before it stops (default: torch's, "
        f"{TORCH_DEFAULT_TIMEOUTS}); raise it when processes finish their documents far apart",
    )
    add_run_arguments(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``per-token-loss``; returns the summary (``{}`` on torchrun ranks other than 0)."""
    rank, world = _dist_info(args.timeout_s)
    out = Path(args.out)
    check_out_shared(out, "per-token-loss")
    if world > 1:
        # a second run into an --out in use stops here, before the model loads, on every rank
        # (one process locks it in fot.eval's main before this; a new --out is made to be
        # locked, and removed again where the run fails)
        with stop_together("while locking --out"):
            if rank == 0:
                lock_out(out)
    overlays = parse_overlays(args.overlay)  # checked before the evaluation, not after
    label = plot_label(args)
    if label in overlays:
        raise ValueError(
            f"--overlay label {label!r} is also this run's label (one curve would hide the "
            "other); rename the overlay (LABEL=DIR) or pass --label"
        )
    own = [k for k, q in overlays.items() if _results_of(q) == _results_of(out)]
    if own:
        raise ValueError(
            f"--overlay {own[0]}={overlays[own[0]]} is this run's own --out, which the plot "
            "draws already (one run drawn twice, as if two); leave it out"
        )
    # checked before the model is loaded
    asked = (  # an empty value is refused, not taken as the default
        length_option(args.length, "--length", minimum=2) if args.length is not None else None
    )
    asked_train = train_length_option(args)
    # missing data (or gcsfs): said before the model loads
    docs, kind = open_documents(args.data, args.storage_options)
    device = pick_device(args.device)
    model, tokenizer = load_checkpoint(args.checkpoint, device=device, dtype=args.dtype)
    docs = documents_for(docs, kind, tokenizer)
    length = asked or model_max_length(model)
    if not length:
        raise ValueError(
            f"{args.checkpoint}'s config names no context length (train_length or "
            "max_position_embeddings): pass --length"
        )
    check_positions(model, length, f"--length {length}")
    train_length = asked_train or model_max_length(model)
    bos = args.prepend_bos == "yes"
    vocab = vocab_size(model)
    if bos and vocab is not None and eot_id(tokenizer) >= vocab:
        raise ValueError(
            f"--prepend-bos yes puts token id {eot_id(tokenizer)} (the tokenizer's "
            f"<|endoftext|>) in front of every document, outside this model's vocabulary of "
            f"{vocab} ids: pass --prepend-bos no, or the model's own tokenizer with it"
        )
    ids = eligible_documents(docs, kind, length, args.max_docs)
    if not ids:
        key = context_length_key(model)
        bound = (
            ": the most positions it takes, not a length it was trained at (fot.convert sets "
            "it to 65536 for the paper's checkpoints)"
            if key == "max_position_embeddings"
            else ""
        )
        source = (
            "" if asked else f" (--length was not given: {length} is the checkpoint's {key}{bound})"
        )
        raise ValueError(
            f"no document in {args.data!r} has at least {length} tokens{source}; pass a lower "
            "--length (e.g. the training length) or use longer held-out data"
        )
    if args.max_docs and len(ids) < args.max_docs and rank == 0:
        # said, not silent: the mean is over fewer documents than asked (and summary.json's
        # num_documents counts them)
        print(
            f"per-token-loss: evaluating {len(ids)} of the {args.max_docs} documents that "
            f"--max-docs asks for: only {len(ids)} documents in {args.data!r} have at least "
            f"{length} tokens (--length)",
            file=sys.stderr,
        )
    # Saved sums resume only a run of the same checkpoint over the same documents and tokens;
    # rank 0 locks --out: where another run holds it, every rank stops (not at the barrier)
    with stop_together("while claiming --out"):
        claim_results(
            out,
            "per_token_loss",
            checkpoint=args.checkpoint,
            settings={
                "--data": path_setting(args.data),
                "--length": length,
                "--prepend-bos": bos,
                "--max-docs": args.max_docs,
                "--dtype": model_dtype(model),
                **escaping_setting(kind, tokenizer),
            },
            state=["state*.npz"],
            outputs=["per_token_loss.npz", "horizons.csv", "summary.json", "per_token_loss.png"],
            restart=args.restart,
            write=rank == 0,
            url_fingerprints=url_fingerprints("--data", docs),
            may_grow=["--max-docs"],  # the first K documents are the first of the first K + 1
        )
    if rank == 0:
        folded = fold_foreign_states(out, world)
        if folded:
            print(
                f"per-token-loss: resuming with {world} process(es): the sums and finished "
                f"documents of {', '.join(folded)} now continue in "
                f"{state_file(out, 0, world).name}",
                file=sys.stderr,
            )
    if world > 1:
        # rank 0 has moved away results (--restart) and folded other layouts' states
        with naming_timeouts(args.timeout_s, out):
            torch.distributed.barrier()
    share = share_of_documents(out, ids, rank, world)
    if world > 1:
        with naming_timeouts(args.timeout_s, out):
            torch.distributed.barrier()  # every rank has read the saved states before any saves
    if rank == 0:
        write_run_config(out, "per-token-loss", vars(args), args.checkpoint)
    acc, _ = evaluate_per_token_loss(
        model,
        docs,
        share,
        length=length,
        batch_size=args.batch_size,
        bos_id=eot_id(tokenizer) if bos else None,
        device=device,
        state_path=state_file(out, rank, world),
        save_every=args.save_every,
        progress=rank == 0,
        processes=world,
        source=f"--data {args.data!r}",
    )
    with naming_timeouts(args.timeout_s, out):
        acc.all_reduce()
    if world > 1:
        torch.distributed.destroy_process_group()
    if rank != 0:
        return {}
    summary = write_results(
        acc, out, length=length, bos=bos, num_docs=len(ids), horizons=default_horizons(acc.length)
    )
    runs = {label: out, **overlays}
    plot_per_token_loss(
        runs, out / "per_token_loss.png", train_length=train_length, smooth=args.smooth
    )
    print(json.dumps({k: summary[k] for k in ("length", "num_documents", "mean_loss")}))
    return summary
