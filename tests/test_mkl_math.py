"""``import fot`` makes the first call of every oneMKL vector-math function torch's CPU kernels
use, one element on one thread (fot/mkl_math.py: pytorch/pytorch#188792)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from fot.mkl_math import VML_FUNCTIONS, resolve_vml_dispatch

HERE = Path(__file__).resolve().parent
GDB = shutil.which("gdb")
needs_mkl = pytest.mark.skipif(
    not torch.backends.mkl.is_available(), reason="torch without MKL: nothing to resolve"
)

# Every float unary function of torch that could reach oneMKL's vector math (those of ATen's
# vml.h over its history and their neighbours); the oracle below says which do.
CANDIDATES = (
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh", "deg2rad",
    "digamma", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac", "i0", "lgamma",
    "log", "log10", "log1p", "log2", "logit", "neg", "rad2deg", "reciprocal", "round", "rsqrt",
    "sigmoid", "sign", "sin", "sinc", "sinh", "sqrt", "square", "tan", "tanh", "trunc",
)  # fmt: skip

PROGRAM = f"""
import os, signal, torch
os.kill(os.getpid(), signal.SIGTRAP)  # gdb sets its breakpoints here
print("PHASE import", flush=True)
import fot
print("PHASE sweep", flush=True)
for name in {CANDIDATES!r}:
    for dtype in (torch.float32, torch.float64):
        print("OP", name, flush=True)
        getattr(torch, name)(torch.full((1,), 0.5, dtype=dtype))
print("PHASE end", flush=True)
"""


@needs_mkl
@pytest.mark.skipif(GDB is None, reason="needs gdb: breakpoints on oneMKL's entry points")
def test_import_fot_calls_every_vml_function_of_torch_once_per_dtype_on_the_main_thread(
    tmp_path,
) -> None:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    # --readnever: no DWARF debug info read (most of gdb's time here, for the libraries that
    # `import fot` loads); the breakpoints are set by symbol name (oneMKL has no debug info)
    args = [GDB, "-batch", "-nx", "--readnever", "-x", str(HERE / "vml_breakpoints.py"), "--args"]
    res = subprocess.run(
        [*args, sys.executable, str(program)], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0 and "PHASE end" in res.stdout, (
        res.stdout[-3000:] + res.stderr[-3000:]
    )
    phase, op = None, None
    during_import: list[tuple[str, str]] = []
    entries_of: dict[str, Counter] = {}  # torch function -> VML entry points its calls reached
    for line in res.stdout.splitlines():
        word, *rest = line.split() or [""]
        if word == "PHASE":
            phase = rest[0]
        elif word == "OP":
            op = rest[0]
            entries_of.setdefault(op, Counter())
        elif word == "VML" and phase == "import":
            during_import.append((rest[0], rest[1]))
        elif word == "VML" and phase == "sweep":
            entries_of[op][rest[0]] += 1
    assert set(entries_of) == set(CANDIDATES)
    # the oracle: the torch functions whose float32 and float64 calls reach oneMKL (one entry
    # point each, vms* and vmd*) are exactly fot's list
    uses_vml = {name for name, entries in entries_of.items() if entries}
    assert uses_vml == set(VML_FUNCTIONS), (uses_vml ^ set(VML_FUNCTIONS), entries_of)
    for name in uses_vml:
        assert sorted(e[:3] for e in entries_of[name].elements()) == ["vmd", "vms"], name
    # `import fot` reached each of those entry points once, on the main thread (gdb's thread 1)
    expected = Counter(e for name in uses_vml for e in entries_of[name].elements())
    assert Counter(e for e, _ in during_import) == expected, during_import
    assert {thread for _, thread in during_import} == {"1"}, during_import


@needs_mkl
def test_resolve_vml_dispatch_calls_each_function_on_one_float32_and_one_float64_element() -> None:
    calls = []

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if args and isinstance(args[0], torch.Tensor) and func.__name__ in VML_FUNCTIONS:
                calls.append((func.__name__, args[0].dtype, args[0].numel(), args[0].device.type))
            return func(*args, **(kwargs or {}))

    with Record():
        assert resolve_vml_dispatch() is True
    expected = [
        (name, dtype, 1, "cpu")
        for dtype in (torch.float32, torch.float64)
        for name in VML_FUNCTIONS
    ]
    assert calls == expected
