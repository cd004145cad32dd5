"""``fot.training.profiling``: interval arithmetic against hand counts, and the step profiler on
CPU (what it writes, and that it profiles exactly the asked steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fot.training.profiling import (
    StepProfiler,
    comm_overlap,
    gpu_timeline,
    is_comm_kernel,
    merge_intervals,
    top_kernels,
)


def test_gpu_timeline_hand_count() -> None:
    """Busy time is the union of the kernel intervals (overlaps counted once), idle the rest of
    the span, and the gaps name the kernels on either side."""
    kernels = [  # (start us, end us, name), unsorted, two overlapping on a side stream
        (1000.0, 1600.0, "c"),
        (0.0, 400.0, "a"),
        (300.0, 500.0, "b"),
        (1700.0, 2000.0, "d"),
    ]
    tl = gpu_timeline(kernels, steps=2)
    # busy: [0, 500] + [1000, 1600] + [1700, 2000] = 1400 us; span 2000 us; over 2 steps
    assert tl["busy_ms_per_step"] == pytest.approx(0.7)
    assert tl["span_ms_per_step"] == pytest.approx(1.0)
    assert tl["idle_ms_per_step"] == pytest.approx(0.3)
    assert tl["largest_gaps"] == [(0.5, "b", "c"), (0.1, "c", "d")]
    assert gpu_timeline([], steps=1)["busy_ms_per_step"] == 0.0


def test_merge_intervals() -> None:
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (8, 9)]) == [(0, 4), (5, 7), (8, 9)]
    assert merge_intervals([]) == []


def test_comm_overlap_hand_count() -> None:
    """Exposed communication is the time a collective runs while no compute kernel does."""
    kernels = [
        (0.0, 100.0, "sm90_xmma_gemm"),
        (150.0, 300.0, "_fwd_kernel"),
        (50.0, 200.0, "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"),
        (290.0, 400.0, "ncclKernel_ReduceScatter_RING_LL_Sum_float"),
    ]
    got = comm_overlap(kernels, steps=2)
    # compute: [0,100] + [150,300] = 250 us; comm: [50,200] + [290,400] = 260 us
    # exposed: [100,150] + [300,400] = 150 us; overlapped: 260 - 150 = 110 us
    assert got["compute_ms"] == pytest.approx(0.125)
    assert got["comm_ms"] == pytest.approx(0.130)
    assert got["exposed_comm_ms"] == pytest.approx(0.075)
    assert got["overlapped_comm_ms"] == pytest.approx(0.055)
    assert is_comm_kernel("ncclDevKernel_AllGather") and not is_comm_kernel("_bwd_dq_kernel")


def test_top_kernels_sums_by_name() -> None:
    kernels = [(0.0, 10.0, "a"), (20.0, 50.0, "b"), (60.0, 90.0, "a")]
    assert top_kernels(kernels, steps=2, n=2) == [("a", 0.020), ("b", 0.015)]
    assert top_kernels(kernels, steps=1, n=1) == [("a", 0.040)]


def test_step_profiler_profiles_the_asked_steps_on_cpu(tmp_path) -> None:
    """Steps 2-3 of 4 are profiled: nothing is written before step 3 ends; the summary counts
    exactly the profiled steps' matmuls (2 steps x 3 per step) and the trace is JSON."""
    prof = StepProfiler(
        steps=2, start_step=1, out_dir=tmp_path, rank=3, device=torch.device("cpu"), trace=True
    )
    a = torch.randn(64, 64)
    written = []
    for _ in range(4):
        prof.step_begin()
        for _ in range(3):
            a = torch.mm(a, a).tanh()
        written.append(prof.step_end())
    assert written[0] is None and written[1] is None and written[3] is None
    summary = written[2]
    on_disk = json.loads((tmp_path / "profile" / "rank3.json").read_text())
    # the run's step numbers (1-based), as the trainer's log: steps 2-3
    assert on_disk["steps"] == 2 and on_disk["first_step"] == 2 and on_disk["rank"] == 3
    assert on_disk["wall_ms_per_step"] == pytest.approx(summary["wall_ms_per_step"])
    assert summary["wall_ms_per_step"] > 0
    names = [name for name, _ in summary["top_cpu_ops"]]
    assert "aten::mm" in names
    trace = json.loads((tmp_path / "profile" / "rank3.trace.json").read_text())
    mm_calls = [e for e in trace["traceEvents"] if e.get("name") == "aten::mm"]
    assert len(mm_calls) == 6


def test_step_profiler_off_and_bad_values(tmp_path) -> None:
    off = StepProfiler(
        steps=0, start_step=0, out_dir=tmp_path, rank=0, device=torch.device("cpu"), trace=True
    )
    off.step_begin()
    assert off.step_end() is None
    assert not (tmp_path / "profile").exists()
    with pytest.raises(ValueError, match=r"profile\.steps and profile\.start_step must be >= 0"):
        StepProfiler(
            steps=-1, start_step=0, out_dir=tmp_path, rank=0, device=torch.device("cpu"),
            trace=False,
        )  # fmt: skip


def test_a_trace_the_profiler_fails_to_write_is_an_error(tmp_path) -> None:
    """torch's profiler only logs a failed trace write (an ERROR line of its C++ writer) and
    returns, leaving a ``.tmp`` file and no trace: the run went on as if the trace were
    written. Now it is a one-line error naming the file, with nothing left behind."""
    from fot.errors import WriteError
    from fot.training.profiling import _export_trace

    class Failing:
        def export_chrome_trace(self, path: str) -> None:
            Path(path + ".tmp").write_text("{")  # what kineto leaves when its rename fails

    target = tmp_path / "rank0.trace.json"
    with pytest.raises(WriteError, match=f"cannot write {target}: torch's profiler could not"):
        _export_trace(Failing(), target)
    assert list(tmp_path.iterdir()) == []
