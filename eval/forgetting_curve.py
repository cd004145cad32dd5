"""Forgetting curve (Liu et al., "Forgetting Curve: A Reliable Method for Evaluating
Memorization Capability for Long-context Models").

For a total length ``L`` let ``n = (L - 2) // 2``. S and I are two unrelated ``n``-token
stretches of real text. Two teacher-forced inputs are scored on the second half of the second
S (the last ``n // 2`` tokens):

* copy:  ``[bos] S [bos] S`` -- a model that remembers S predicts these tokens exactly;
* LM:    ``[bos] I [bos] S`` -- the same tokens predicted from language modelling alone.

Accuracy is top-1 next-token accuracy. Over a grid of lengths with repeats:

* fine-grained memory length: the largest grid length up to which copy accuracy >= 99%
  at every grid length;
* coarse-grained memory length: the largest grid length up to which copy accuracy exceeds
  LM accuracy by more than 1 point at every grid length.

S and I of a cell of length ``L`` are drawn from the first :func:`span_window` ``(L)`` tokens
of the data: a cell's text depends on its own length, repeat and seed only, not on the other
lengths of the grid (so a grid extended on a rerun equals a fresh run of the final grid). The
data's documents are read as fot's trainer packs them, each after a BOS: S or I that spans two
documents holds the BOS between them, and neither starts nor ends with one (``[bos] [bos]``
never occurs in training). A BOS id inside a document is such a boundary too: the trainer
starts a document at it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fot.data.streams import EOT_ID
from fot.progress import progress_bar
from fot.training.checkpoint import write_text_atomic

from .common import (
    CHECKPOINT_HELP,
    JsonlLog,
    add_label_argument,
    add_run_arguments,
    add_storage_options_argument,
    add_train_length_argument,
    check_fits_memory,
    check_grid,
    check_out_shared,
    check_positions,
    check_token_ids,
    claim_results,
    eot_id,
    list_option,
    load_checkpoint,
    model_dtype,
    model_max_length,
    next_token_argmax,
    parse_int_list,
    path_setting,
    pick_device,
    plot_label,
    save_figure,
    train_length_option,
    use_agg_backend,
    vocab_size,
    write_run_config,
)

FINE_THRESHOLD = 0.99
COARSE_MARGIN = 0.01
MIN_WINDOW = 200_000
"""The fewest tokens of the data that S and I of any cell are drawn from (:func:`span_window`)."""

SPANS_SETTING = (
    "S and I of a cell of length L",
    f"drawn from the first max(20 L, {MIN_WINDOW}) tokens of --data (fot before this drew "
    "them from a stretch set by the run's longest --lengths)",
)
"""The resume record's entry for how cells draw their text, recorded for data of
:data:`MIN_WINDOW` tokens or more, where the rule can change a cell (whether or not a saved one
changed): records without it are refused there. Below that, every cell drew the whole data."""

BOS_SETTING = (
    "documents in S and I",
    "each after a BOS, as fot's trainer reads them (fot before this joined them without one)",
)
"""The resume record's entry for the BOS between documents, recorded for data of more than one
document, or of one whose tokens hold the BOS id (a boundary, as in training), where it can
change a cell: records without it are refused there."""


def span_window(length: int) -> int:
    """How many of the data's first tokens S and I of a cell of ``length`` are drawn from:
    ``max(20 * length, MIN_WINDOW)``, room for many disjoint pairs at every length."""
    return max(20 * length, MIN_WINDOW)


def build_pair(
    s: Sequence[int], irrelevant: Sequence[int], bos_id: int
) -> tuple[list[int], list[int], int, int]:
    """The copy and LM inputs and the scored target range.

    Args:
        s: the text S (``n`` tokens); irrelevant: the text I (``n`` tokens).
        bos_id: separator/BOS token.

    Returns:
        ``(copy_ids, lm_ids, start, end)``: both inputs have ``2n + 2`` tokens; targets at
        positions ``start..end-1`` (the second half of the second S) are scored.
    """
    n = len(s)
    if len(irrelevant) != n or n < 2:
        raise ValueError(f"S and I must have the same length >= 2, got {n} and {len(irrelevant)}")
    copy_ids = [bos_id, *s, bos_id, *s]
    lm_ids = [bos_id, *irrelevant, bos_id, *s]
    end = 2 * n + 2
    return copy_ids, lm_ids, end - n // 2, end


@torch.no_grad()
def teacher_forced_accuracy(
    model: torch.nn.Module, ids: Sequence[int], start: int, end: int
) -> float:
    """Fraction of target positions ``start..end-1`` whose token is the model's argmax.

    Args:
        ids: the input tokens (``end <= len(ids)``).
        start, end: target positions (token ``ids[t]`` predicted from ``ids[:t]``), ``start >= 1``.
    """
    if start < 1:
        raise ValueError(f"start must be >= 1 (position 0 has no context), got {start}")
    device = next(model.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    pred = next_token_argmax(model, x, start - 1, end - 1)  # predictions of tokens start..end-1
    return float((pred[0] == x[0, start:end]).float().mean())


def memory_lengths(
    lengths: Sequence[int], copy_acc: Sequence[float], lm_acc: Sequence[float]
) -> dict[str, int]:
    """Fine- and coarse-grained memory lengths from mean accuracies per grid length."""
    order = np.argsort(lengths)
    fine = coarse = 0
    fine_ok = coarse_ok = True
    for i in order:
        fine_ok = fine_ok and copy_acc[i] >= FINE_THRESHOLD
        coarse_ok = coarse_ok and copy_acc[i] > lm_acc[i] + COARSE_MARGIN
        if fine_ok:
            fine = int(lengths[i])
        if coarse_ok:
            coarse = int(lengths[i])
    return {"fine_grained_length": fine, "coarse_grained_length": coarse}


def sample_pair(
    stream: np.ndarray, n: int, rng: np.random.Generator, bos_id: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Two non-overlapping random ``n``-token spans (S, I) of ``stream``.

    Args:
        bos_id: the BOS between the stream's documents: no span starts or ends with it (the
            inputs put a BOS before each span, and two in a row never occur in training).
            Spans are drawn as without it where the stream holds none.

    Raises:
        ValueError: ``stream`` has fewer than ``2 n`` tokens (S and I would share text), or
            no two separate spans that neither start nor end with ``bos_id``.
    """
    if len(stream) < 2 * n:
        raise ValueError(
            f"S and I of {n} tokens each need {2 * n} tokens of text, the data holds {len(stream)}"
        )
    starts = len(stream) - n + 1
    ok = np.ones(starts, dtype=bool)
    if bos_id is not None:
        ok &= (stream[:starts] != bos_id) & (stream[n - 1 :] != bos_id)
    at = np.flatnonzero(ok)  # where a span may start
    if len(at) == 0 or at[-1] - at[0] < n:
        raise ValueError(
            f"S and I of {n} tokens each need two separate spans that neither start nor end at a "
            "document's boundary, and the data's documents leave none"
        )
    if len(stream) < 4 * n:
        # Short stream: the slack (tokens outside S and I) is split at random, in either order.
        while True:
            lo, hi = sorted(int(x) for x in rng.integers(0, len(stream) - 2 * n + 1, size=2))
            if ok[lo] and ok[hi + n]:
                first, second = stream[lo : lo + n], stream[hi + n : hi + 2 * n]
                return (first, second) if rng.integers(2) else (second, first)
    while True:
        a = int(at[rng.integers(0, len(at))])
        if a - at[0] < n and at[-1] - a < n:
            continue  # no span starts n tokens away from this one
        while True:  # terminates fast: most starts are n tokens away from a
            b = int(at[rng.integers(0, len(at))])
            if abs(b - a) >= n:
                return stream[a : a + n], stream[b : b + n]


def run_curve(
    model: torch.nn.Module,
    stream: np.ndarray,
    *,
    lengths: Sequence[int],
    repeats: int,
    bos_id: int,
    log: JsonlLog,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Score every (length, repeat) not yet in ``log``; return this grid's records.

    Args:
        stream: token ids of a corpus, ``bos_id`` between its documents (:func:`token_stream`);
            S and I of a cell of length ``L`` are disjoint random spans of its first
            :func:`span_window` ``(L)`` tokens that neither start nor end with ``bos_id``, so
            that a cell does not depend on the grid's other lengths (nor on how much more of
            the corpus is given).
    """
    cells = [(L, r) for L in lengths for r in range(repeats)]
    todo = [c for c in cells if not log.done(f"{c[0]}:{c[1]}")]
    for L, r in progress_bar(
        todo,
        disable=not progress,
        desc="forgetting curve",
        unit="seq",
        initial=len(cells) - len(todo),
        total=len(cells),
    ):
        n = (L - 2) // 2
        if n < 2:
            raise ValueError(f"length {L} is too short: need at least 6 tokens")
        rng = np.random.default_rng([seed, L, r])
        s, irrelevant = sample_pair(stream[: span_window(L)], n, rng, bos_id)
        copy_ids, lm_ids, start, end = build_pair(s.tolist(), irrelevant.tolist(), bos_id)
        log.append(
            {
                "key": f"{L}:{r}",
                "length": L,
                "repeat": r,
                "n": n,
                "copy_accuracy": teacher_forced_accuracy(model, copy_ids, start, end),
                "lm_accuracy": teacher_forced_accuracy(model, lm_ids, start, end),
            }
        )
    keys = {f"{L}:{r}" for L, r in cells}
    return [rec for rec in log if rec["key"] in keys]


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean/std/min/max accuracies per length and the two memory lengths."""
    lengths = sorted({int(r["length"]) for r in records})
    rows = []
    for L in lengths:
        c = np.array([r["copy_accuracy"] for r in records if r["length"] == L])
        m = np.array([r["lm_accuracy"] for r in records if r["length"] == L])
        rows.append(
            {
                "length": L,
                "repeats": len(c),
                "copy_mean": float(c.mean()),
                "copy_std": float(c.std()),
                "copy_min": float(c.min()),
                "copy_max": float(c.max()),
                "lm_mean": float(m.mean()),
                "lm_std": float(m.std()),
                "lm_min": float(m.min()),
                "lm_max": float(m.max()),
            }
        )
    mem = memory_lengths(lengths, [r["copy_mean"] for r in rows], [r["lm_mean"] for r in rows])
    return {"per_length": rows, **mem}


def plot_curve(
    summary: dict[str, Any], out_file: Path, *, train_length: int | None = None, title: str = ""
) -> Path:
    """Copy and LM accuracy vs length with min--max bands and the memory lengths marked."""
    use_agg_backend(out_file)
    import matplotlib.pyplot as plt

    rows = summary["per_length"]
    x = np.array([r["length"] for r in rows])
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("copy", "tab:blue"), ("lm", "tab:orange")):
        mean = np.array([r[f"{name}_mean"] for r in rows])
        ax.plot(
            x,
            mean,
            marker="o",
            ms=3,
            color=color,
            label="copy [bos] S [bos] S" if name == "copy" else "LM [bos] I [bos] S",
        )
        ax.fill_between(
            x,
            [r[f"{name}_min"] for r in rows],
            [r[f"{name}_max"] for r in rows],
            color=color,
            alpha=0.2,
        )
    for grain, color in (("fine", "tab:green"), ("coarse", "tab:red")):
        length = summary[f"{grain}_grained_length"]
        if length:
            ax.axvline(length, color=color, ls=":", lw=1.2, label=f"{grain}-grained {length}")
    if train_length:
        ax.axvline(train_length, color="gray", ls="--", lw=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("next-token accuracy (second half of 2nd S)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return save_figure(fig, out_file)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``forgetting-curve`` command's options."""
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument(
        "--lengths",
        default="256,512,1k,2k,4k,8k,16k,32k",
        help="total sequence lengths, k = 1024 (default: %(default)s)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="sequences per length (default: %(default)s)"
    )
    p.add_argument(
        "--data",
        default="sample",
        help="'sample', a token folder, or a zarr array or its URL "
        "(gs://<bucket>/heldout.zarr; any fsspec URL): the source of S and I "
        "(default: %(default)s)",
    )
    add_storage_options_argument(p)
    add_train_length_argument(p, "training length marked on the plot")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the S and I spans (default: %(default)s)"
    )
    add_label_argument(p, "the plot's title")
    add_run_arguments(p)


def token_stream(
    docs: Sequence[np.ndarray], source: str, max_tokens: int, bos_id: int
) -> np.ndarray:
    """Documents of ``--data`` (``docs``, opened from ``source``) as fot's trainer packs them,
    with ``bos_id`` between each and the next, until at least ``max_tokens`` (or all of them).
    The first document's BOS is left out: the inputs put one before S and I."""
    from .per_token_loss import num_documents

    parts, total = [], 0
    for i in range(num_documents(docs)):
        d = np.asarray(docs[i])
        if not np.issubdtype(d.dtype, np.integer):
            raise ValueError(
                f"--data {source!r} document {i} holds {d.dtype} values, not token ids"
            )
        if len(d) == 0:  # skipped, as the trainer skips it (a lone BOS)
            continue
        if parts:
            parts.append(np.array([bos_id], dtype=np.int64))
        parts.append(d.astype(np.int64))
        total += len(d) + (len(parts) > 1)
        if total >= max_tokens:
            break
    if total == 0:
        raise ValueError(f"--data {source!r} holds no tokens")
    return np.concatenate(parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``forgetting-curve``; returns the summary (per-length accuracies, memory lengths)."""
    out = Path(args.out)
    lengths = parse_int_list(list_option(args.lengths, "--lengths"), "--lengths")
    check_out_shared(out, "forgetting-curve")
    # Everything that can be checked without the model is checked before it loads.
    check_grid(lengths, "--lengths", minimum=6)  # n = (L - 2) // 2 >= 2 tokens
    odd = [L for L in lengths if L % 2]
    if odd:  # [bos] S [bos] S is 2n + 2 tokens: an odd L would be scored as L - 1
        raise ValueError(
            f"--lengths must be even (the inputs are [bos] S [bos] S, two spans of "
            f"(L - 2) / 2 tokens), got {', '.join(map(str, odd))}; use e.g. {odd[0] + 1}"
        )
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    train_length = train_length_option(args)
    from .per_token_loss import (
        documents_for,
        escaping_setting,
        num_documents,
        open_documents,
        url_fingerprints,
    )

    docs, kind = open_documents(args.data, args.storage_options)  # missing data, gcsfs: now
    # read once: the cells of every length draw from the first span_window(L) tokens of it
    stream = token_stream(docs, args.data, span_window(max(lengths)), EOT_ID)
    n = (max(lengths) - 2) // 2
    if len(stream) < 2 * n:  # S and I are disjoint: the text is never repeated
        raise ValueError(
            f"--lengths up to {max(lengths)} needs two separate spans S and I of {n} tokens, "
            f"{2 * n} tokens in all, but --data {args.data!r} holds {len(stream)} tokens; pass "
            "more data or lower --lengths"
        )
    model, tokenizer = load_checkpoint(
        args.checkpoint, device=pick_device(args.device), dtype=args.dtype
    )
    bos_id = eot_id(tokenizer)
    if (escaped := documents_for(docs, kind, tokenizer)) is not docs or bos_id != EOT_ID:
        docs = escaped  # the sample, escaped; or another tokenizer's BOS between documents
        stream = token_stream(docs, args.data, span_window(max(lengths)), bos_id)
    check_positions(model, max(lengths), f"--lengths up to {max(lengths)}")
    check_fits_memory(model, max(lengths), f"--lengths up to {max(lengths)}")
    check_token_ids(stream, vocab_size(model), f"--data {args.data!r}")
    # (length, repeat) cells extend the saved grid, of the same checkpoint and data only.
    claim_results(
        out,
        "forgetting_curve",
        checkpoint=args.checkpoint,
        settings={
            "--data": path_setting(args.data),
            "--seed": args.seed,
            "--dtype": model_dtype(model),
            **escaping_setting(kind, tokenizer),
            # data shorter than every window (the sample): cells drew the same text before
            # the rule changed, so records without this entry still resume
            **(dict([SPANS_SETTING]) if len(stream) >= MIN_WINDOW else {}),
            # data of one document without the BOS id: no boundary in it, records without
            # the entry still resume
            **(
                dict([BOS_SETTING])
                if num_documents(docs) > 1 or bool((stream == bos_id).any())
                else {}
            ),
        },
        state=["forgetting_curve.jsonl"],
        outputs=["forgetting_curve.csv", "summary.json", "forgetting_curve.png"],
        restart=args.restart,
        url_fingerprints=url_fingerprints("--data", docs),
    )
    write_run_config(out, "forgetting-curve", vars(args), args.checkpoint)
    log = JsonlLog(out / "forgetting_curve.jsonl")
    records = run_curve(
        model,
        stream,
        lengths=lengths,
        repeats=args.repeats,
        bos_id=bos_id,
        log=log,
        seed=args.seed,
    )
    summary = summarize(records)
    cols = list(summary["per_length"][0])
    rows = [",".join(str(r[c]) for c in cols) + "\n" for r in summary["per_length"]]
    write_text_atomic(out / "forgetting_curve.csv", ",".join(cols) + "\n" + "".join(rows))
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    plot_curve(
        summary,
        out / "forgetting_curve.png",
        train_length=train_length or model_max_length(model),
        title=plot_label(args),
    )
    print(json.dumps({k: summary[k] for k in ("fine_grained_length", "coarse_grained_length")}))
    return summary
