"""Progress bars that also read well in a log file.

On a terminal (or in a notebook) :func:`progress_bar` is tqdm's bar, redrawn in place. When
stderr goes to a file (a Slurm job's output, ``> log 2>&1``, ``nohup``), tqdm would append
every redraw to one line joined by carriage returns: a run of days becomes a single line of
megabytes that ``tail`` cannot show. There the bar is written as a plain line at most every
:data:`LOG_INTERVAL_S` seconds, and once more when it ends.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from typing import IO, Any

LOG_INTERVAL_S = 30.0
"""Seconds between two progress lines when stderr is not a terminal."""

# what tqdm writes to redraw in place: carriage returns and "cursor up" (nested bars)
_REDRAW = re.compile(r"\r|\x1b\[A")


def on_terminal(stream: IO[str] | None = None) -> bool:
    """Whether ``stream`` (default: stderr) is shown live: a terminal, or a Jupyter/IPython
    kernel's output (whose bar tqdm draws as a widget)."""
    stream = sys.stderr if stream is None else stream
    if type(stream).__module__.startswith("ipykernel"):
        return True
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


class _LineStream:
    """A text stream for tqdm off a terminal: each redraw of the bar becomes one line."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        for line in _REDRAW.sub("\n", text).split("\n"):
            if line.strip():
                self._stream.write(line.strip() + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def progress_bar(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(iterable, **kwargs)`` writing to stderr; off a terminal (see
    :func:`on_terminal`) it writes a plain line (``45%|####5 | 9/20 [00:31<00:38, ...]``) at most
    every :data:`LOG_INTERVAL_S` seconds and when it closes. ``kwargs`` are tqdm's (``total``,
    ``initial``, ``desc``, ``unit``, ``disable``, ...)."""
    from tqdm.auto import tqdm

    if "file" not in kwargs and not on_terminal():
        kwargs = {
            **kwargs,
            "file": _LineStream(sys.stderr),
            "mininterval": max(kwargs.get("mininterval", 0.0), LOG_INTERVAL_S),
            # the clock is read at every update; tqdm's monitor thread, which redraws a bar
            # whose dynamic miniters skipped updates, would add a line between two intervals
            "miniters": 1,
            "ascii": True,
            "dynamic_ncols": False,
        }
    return tqdm(iterable, **kwargs)


def quiet_library_bars(rank: int = 0) -> None:
    """Turn off transformers' and datasets' own progress bars (loading or writing weights,
    downloading, generating a split) off a terminal, where tqdm would append their redraws to
    one line joined by carriage returns, and on every process but rank 0 (under torchrun each
    would draw the same bar). For the command-line entry points: it changes the libraries'
    settings for the whole process (for datasets not imported yet, through
    HF_DATASETS_DISABLE_PROGRESS_BARS in the environment, which child processes inherit).

    Args:
        rank: this process's rank.
    """
    if on_terminal() and rank == 0:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets = sys.modules.get("datasets")
    if datasets is None:
        # not imported yet (a run without HF data never imports it): importing datasets, with
        # pandas and pyarrow, took ~0.5 s of every start; it reads this variable when imported.
        # A value the user set stays (it has priority over disable_progress_bars as well)
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        return
    datasets.disable_progress_bars()
