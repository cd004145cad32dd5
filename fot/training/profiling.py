"""Profile a few training steps with ``torch.profiler``: where each rank's GPU time goes.

For every rank, :class:`StepProfiler` writes ``<out_dir>/profile/rank<r>.json``: the wall time
per step, the GPU timeline (busy, idle: no kernel running, the largest idle gaps), the
communication overlap (collective kernel time, and the part of it during which no compute
kernel ran: *exposed* communication) and the kernels that took the most time; optionally a
Chrome trace ``rank<r>.trace.json`` (open it in ``chrome://tracing`` or Perfetto). On CPU
there are no device kernels and the summary lists the ops with the most CPU time instead.

Kernel intervals are ``(start_us, end_us, name)`` tuples; everything here is plain interval
arithmetic over them, so it is tested with hand-built intervals.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from fot.errors import WriteError, cannot_write

Interval = tuple[float, float, str]

COMM_KERNEL_MARKERS = ("nccl",)
"""Substrings (lower case) of the names of collective-communication kernels."""


def is_comm_kernel(name: str) -> bool:
    """Whether a kernel name is a collective (NCCL) kernel."""
    low = name.lower()
    return any(m in low for m in COMM_KERNEL_MARKERS)


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def gpu_timeline(kernels: list[Interval], steps: int) -> dict[str, Any]:
    """How busy the GPU was over ``steps`` steps of kernel intervals ``(start_us, end_us,
    name)``: per step, busy time (the union of the intervals), span (first start to last
    end), idle (span - busy: no kernel running, e.g. the GPU waiting for the host) in ms, and
    the 10 largest gaps ``(ms, kernel before, kernel after)``."""
    if not kernels:
        return {"busy_ms_per_step": 0.0, "span_ms_per_step": 0.0, "idle_ms_per_step": 0.0,
                "largest_gaps": []}  # fmt: skip
    kernels = sorted(kernels)
    busy, gaps = 0.0, []
    run_start, run_end, last = kernels[0][0], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > run_end:  # the GPU was idle from run_end to start
            busy += run_end - run_start
            gaps.append(((start - run_end) / 1e3, last[:80], name[:80]))
            run_start = start
        if end >= run_end:
            run_end, last = end, name
    busy += run_end - run_start
    span = run_end - kernels[0][0]
    return {
        "busy_ms_per_step": busy / 1e3 / steps,
        "span_ms_per_step": span / 1e3 / steps,
        "idle_ms_per_step": (span - busy) / 1e3 / steps,
        "largest_gaps": sorted(gaps, key=lambda g: -g[0])[:10],
    }


def comm_overlap(kernels: list[Interval], steps: int) -> dict[str, float]:
    """Communication against compute, ms per step: ``compute_ms`` (union of the non-collective
    kernels), ``comm_ms`` (union of the collective kernels), ``exposed_comm_ms`` (time when a
    collective ran and no compute kernel did; it includes a rank waiting inside a collective
    for a slower rank) and ``overlapped_comm_ms`` (the rest of ``comm_ms``)."""
    comp = merge_intervals([(s, e) for s, e, n in kernels if not is_comm_kernel(n)])
    comm = merge_intervals([(s, e) for s, e, n in kernels if is_comm_kernel(n)])
    both = merge_intervals(comp + comm)
    exposed = _length(both) - _length(comp)
    comm_len = _length(comm)
    return {
        "compute_ms": _length(comp) / 1e3 / steps,
        "comm_ms": comm_len / 1e3 / steps,
        "exposed_comm_ms": exposed / 1e3 / steps,
        "overlapped_comm_ms": (comm_len - exposed) / 1e3 / steps,
    }


def top_kernels(kernels: list[Interval], steps: int, n: int = 15) -> list[tuple[str, float]]:
    """The ``n`` kernel names with the most total time, ``(name, ms per step)``."""
    total: dict[str, float] = {}
    for start, end, name in kernels:
        total[name] = total.get(name, 0.0) + (end - start)
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    return [(name[:120], us / 1e3 / steps) for name, us in ranked]


class StepProfiler:
    """Profiles training steps ``[start_step, start_step + steps)`` of one run (counted from
    the first step this process runs, so warm-up steps are skipped) and writes the summary.
    Its ``first_step`` is the run's number of the first profiled step: ``first_run_step`` (the
    number of the first step this process runs: 1, or the resumed step + 1) + ``start_step``.

    Call :meth:`step_begin` before each step and :meth:`step_end` after it. With ``steps=0``
    both do nothing.
    """

    def __init__(
        self,
        *,
        steps: int,
        start_step: int,
        out_dir: Path,
        rank: int,
        device: torch.device,
        trace: bool,
        first_run_step: int = 1,
    ) -> None:
        if steps < 0 or start_step < 0:
            raise ValueError(
                f"profile.steps and profile.start_step must be >= 0, got {steps} and {start_step}"
            )
        self.steps, self.start_step, self.rank = steps, start_step, rank
        self.first_run_step = first_run_step
        self.out_dir, self.device, self.trace = Path(out_dir) / "profile", device, trace
        self._done = 0  # steps of this run finished so far
        self._prof: Any = None
        self._t0 = 0.0
        self.stop_s = 0.0
        """Seconds the last :meth:`step_end` that finished the profile took to stop the
        profiler and write its files, after the profiled steps' GPU work was done (no
        training time: the trainer leaves it out of tokens/s)."""

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_begin(self) -> None:
        """Start the profiler if the next step is the first profiled one."""
        if self.steps and self._done == self.start_step:
            from torch.profiler import ProfilerActivity, profile

            # On CUDA, CPU ops are recorded only for the trace: recording them slows the host
            # down enough to leave the GPU idle where it otherwise would not be.
            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts = [ProfilerActivity.CUDA] + (acts if self.trace else [])
            self._sync()
            self._prof = profile(activities=acts)
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    @property
    def finishing(self) -> bool:
        """Whether the next :meth:`step_end` stops the profiler and writes the files (the
        same on every rank: the trainer makes the ranks agree on a failed write there)."""
        return self._prof is not None and self._done + 1 == self.start_step + self.steps

    def step_end(self) -> dict[str, Any] | None:
        """Count a finished step; after the last profiled one, stop, write and return the
        summary (else return None)."""
        self._done += 1
        if self._prof is None or self._done != self.start_step + self.steps:
            return None
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        summary = self._write(prof, wall)
        self.stop_s = time.perf_counter() - self._t0 - wall
        return summary

    def _write(self, prof: Any, wall_s: float) -> dict[str, Any]:
        n = self.steps
        summary: dict[str, Any] = {
            "rank": self.rank,
            "device": str(self.device),
            "steps": n,
            "first_step": self.first_run_step + self.start_step,
            "wall_ms_per_step": wall_s * 1e3 / n,
        }
        if self.device.type == "cuda":
            # Kernels and copies; user annotations are ranges around kernels listed anyway.
            kernels = [
                (e.time_range.start, e.time_range.end, e.name)
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA
                and e.device_time_total > 0
                and not getattr(e, "is_user_annotation", False)
            ]
            summary["timeline"] = gpu_timeline(kernels, n)
            summary["comm"] = comm_overlap(kernels, n)
            summary["top_kernels"] = top_kernels(kernels, n)
        else:
            ops = sorted(
                ((a.key, a.self_cpu_time_total / 1e3 / n) for a in prof.key_averages()),
                key=lambda kv: -kv[1],
            )
            summary["top_cpu_ops"] = [(k[:120], ms) for k, ms in ops[:15] if ms > 0]
        path = self.out_dir
        try:  # a read-only or full disk: one line naming the file, not a traceback
            path.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"rank{self.rank}.json"
            path.write_text(json.dumps(summary, indent=2) + "\n")
            if self.trace:
                path = self.out_dir / f"rank{self.rank}.trace.json"
                _export_trace(prof, path)
        except OSError as err:
            raise cannot_write(path, err) or err from err
        return summary


def _export_trace(prof: Any, path: Path) -> None:
    """``prof.export_chrome_trace`` into ``path``, raising where it fails: torch's profiler
    only logs a failed write (an ERROR line of its C++ writer) and returns, leaving no trace
    and a ``.tmp`` file behind."""
    written = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        prof.export_chrome_trace(str(written))
        if not written.is_file():
            raise WriteError(
                f"cannot write {path}: torch's profiler could not write the trace (its ERROR "
                "line above says why)"
            )
        os.replace(written, path)
    finally:
        for leftover in (written, written.with_name(written.name + ".tmp")):
            leftover.unlink(missing_ok=True)


__all__ = [
    "COMM_KERNEL_MARKERS",
    "StepProfiler",
    "comm_overlap",
    "gpu_timeline",
    "is_comm_kernel",
    "merge_intervals",
    "top_kernels",
]
