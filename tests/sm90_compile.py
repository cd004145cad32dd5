"""Compile Triton kernels for a Hopper GPU without one and read their register use.

Catches what the interpreter lets through (register spills, shapes the compiler refuses): the
kernels are compiled for sm_90 with Triton's bundled ptxas in a subprocess (without
``TRITON_INTERPRET``), and ``cuobjdump --dump-resource-usage`` reports registers, stack and
local memory per kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import importlib, json, os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module_name, jobs = sys.argv[1], json.loads(sys.argv[2])
module = importlib.import_module(module_name)
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
out = {}
for label, fn, ptrs, consts, warps, div16, *extra in jobs:
    options = {"num_warps": warps, **(extra[0] if extra else {})}
    kernel = getattr(module, fn)
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "eps" else "i32")
           for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n in div16}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    cubin = os.path.join(os.environ["TRITON_CACHE_DIR"], label.replace("/", "_") + ".cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True,
                           text=True, check=True).stdout
    line = [line.strip() for line in usage.splitlines() if "REG:" in line][0]
    out[label] = f"{line} DYNAMIC_SHARED:{compiled.metadata.shared}"
print(json.dumps(out))
"""


def resource_usage(module: str, jobs: list[tuple], cache_dir: Path) -> dict[str, str]:
    """Compile each job's kernel for sm_90; ``{label: cuobjdump's "REG:... STACK:... LOCAL:..."
    line, then " DYNAMIC_SHARED:<bytes>"}``, the shared memory Triton asks for at launch (its
    pipeline buffers; cuobjdump's ``SHARED`` counts only the static part).

    Args:
        module: the kernels' module, e.g. ``"fot.kernels._pro_kernels"``.
        jobs: ``(label, kernel name, {pointer or scalar arg: "*bf16" / "fp32" ...},
            {constexpr arg: value}, num_warps, [integer args to mark divisible by 16, as the
            JIT sees 16-byte aligned strides], optional {compile option: value} such as
            ``num_stages`` or ``maxnreg``)``; other arguments are ``i32`` (``eps`` ``fp32``).
        cache_dir: Triton's cache for the subprocess (a fresh temporary directory); the
            cubins that cuobjdump reads are written there too.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, module, json.dumps(jobs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_no_spills(usage: dict[str, str]) -> None:
    """No stack and no local memory in any kernel (register spills go there)."""
    for label, line in usage.items():
        assert "STACK:0 " in line and "LOCAL:0 " in line, f"{label} spills: {line}"


SM90_SHARED_BYTES = 232_448
"""The most shared memory one block may use on an H100 or H200 (227 KiB): what Triton's
launcher checks, raising ``OutOfResources`` above it."""


def assert_fits_shared(usage: dict[str, str], limit: int = SM90_SHARED_BYTES) -> None:
    """Every kernel's shared memory (static and Triton's dynamic part) within ``limit`` bytes."""
    for label, line in usage.items():
        static = int(line.split("SHARED:", 1)[1].split()[0])
        dynamic = int(line.rsplit("DYNAMIC_SHARED:", 1)[1])
        assert max(static, dynamic) <= limit, f"{label} needs {max(static, dynamic)} bytes: {line}"
