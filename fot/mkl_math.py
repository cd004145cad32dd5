"""Keep torch's CPU math functions exact on their first call (a oneMKL dispatch race).

On x86 CPU builds, torch computes ``sqrt``, ``exp``, ``log`` and a dozen more float32/float64
functions of contiguous tensors with oneMKL's vector math (VML), each intra-op thread on its
own chunk, asking for VML's high-accuracy kernels. oneMKL picks each function's kernel on the
function's first call in the process. When several threads make that first call at once, one
of them can run a low-accuracy kernel for its whole chunk of that one call (pytorch/pytorch
#188792 reports it for oneMKL 2024.2, the version in torch 2.11.0's and 2.13.0's x86 wheels,
and not for oneMKL >= 2025.0).

Measured with torch 2.13.0 on 2 cores by a one-off script (not kept in the repository) that
ran tests/test_train.py's tiny CPU training four copies at a time, each in a fresh process, and
hashed every gradient, Adam moment and parameter at each step: in 15 of 271 runs the main
thread's half of AdamW's first ``exp_avg_sq.sqrt()`` (of the embedding) had relative errors up
to 3.1e-4 (about 12 correct bits), and every later loss differed in its last bits from the
other runs'. Exact-resume tests failed now and then
for it. With :func:`resolve_vml_dispatch`, which ``import fot`` runs, none of 200 runs did;
100 of them ran side by side with 100 runs without it, 5 of which did.
"""

from __future__ import annotations

import torch

# The torch functions whose float32/float64 CPU kernels call oneMKL VML (checked with a
# breakpoint on the vms*/vmd* entry points of libtorch_cpu, torch 2.13.0: one call each).
VML_FUNCTIONS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)


def resolve_vml_dispatch() -> bool:
    """Call each of :data:`VML_FUNCTIONS` once on a one-element float32 and float64 CPU tensor.

    One element runs on the calling thread only (torch splits a tensor among its threads from
    32,768 elements on), so oneMKL chooses each function's kernel with no other thread inside
    it; later calls from many threads use that choice. Took 1.3 to 5.4 ms on 2 busy cores. Does
    nothing in a torch without MKL (ARM, macOS), where none of this applies.

    Returns:
        Whether the calls were made (torch has MKL).
    """
    if not torch.backends.mkl.is_available():
        return False
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            x = torch.full((1,), 0.5, dtype=dtype)
            for name in VML_FUNCTIONS:
                getattr(torch, name)(x)
    return True
