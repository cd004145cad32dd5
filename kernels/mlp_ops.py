"""Fused SwiGLU activation: ``silu(gate) * up`` from one ``[..., 2 * I]`` projection output.

Layers: jit kernels -> launchers -> private ``autograd.Function`` -> public :func:`swiglu`.

The MLP's gate and up projections come out of one GEMM as ``[gate | up]`` along the last dim.
In PyTorch, ``silu(gate) * up`` on the two column halves runs strided elementwise kernels,
keeps ``silu(gate)`` for backward, and the backward assembles the input gradient by
concatenating the two halves' gradients. Here the forward is one kernel (float32 math, one
rounding), only the input is saved, and the backward is one kernel that writes the
``[..., 2 * I]`` input gradient directly. On tensors that are not on CUDA, without
``TRITON_INTERPRET=1``, the same function runs as PyTorch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import differentiable_once, on_input_gpu
from .forgetting_attention import _interpreting

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _swiglu_fwd_kernel(X, Y, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x_row = X + row * stride_x
    gate = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(X, DY, DX, n_cols, stride_x, stride_dy, stride_dx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x_row = X + row * stride_x
    gate = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    dgate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    dx_row = DX + row * stride_dx
    tl.store(dx_row + cols, dgate.to(DX.dtype.element_ty), mask=ok)
    tl.store(dx_row + n_cols + cols, (dy * silu).to(DX.dtype.element_ty), mask=ok)


def _block(n_cols: int) -> int:
    """Columns per program: up to 1024 on a GPU; the whole row under the interpreter, which
    pays per program."""
    if _interpreting():
        return triton.next_power_of_2(n_cols)
    return min(1024, triton.next_power_of_2(n_cols))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, cols]`` with unit column stride (a view when the layout allows it)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _fwd(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    rows, n = x2.shape[0], x2.shape[1] // 2
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = _block(n)
        _swiglu_fwd_kernel[(rows, triton.cdiv(n, block))](
            x2, y, n, x2.stride(0), y.stride(0), BLOCK=block, num_warps=4
        )
    return y.view(*x.shape[:-1], n)


def _bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    x2, dy2 = _rows(x), _rows(dy)
    rows, n = dy2.shape
    dx = torch.empty((rows, 2 * n), dtype=x.dtype, device=x.device)
    if rows:
        block = _block(n)
        _swiglu_bwd_kernel[(rows, triton.cdiv(n, block))](
            x2, dy2, dx, n, x2.stride(0), dy2.stride(0), dx.stride(0), BLOCK=block, num_warps=4
        )
    return dx.view(x.shape)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _fwd(x)

    @staticmethod
    @differentiable_once(
        "swiglu",
        "Use F.silu(gate) * up, which has one (in a fot model, attn_backend='reference' and loss_impl='chunked').",
    )
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _bwd(x, dy)


@on_input_gpu
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` of last dim ``2 * I`` (gate then up).

    Args:
        x: ``[..., 2 * I]`` float16/bfloat16/float32, e.g. the output of one GEMM over the
            concatenated gate and up weights. Triton on CUDA (or under
            ``TRITON_INTERPRET=1``); PyTorch ops elsewhere.

    Returns:
        ``[..., I]`` in ``x``'s dtype (float32 math inside, one rounding). Differentiable once
        in ``x`` (on the Triton path a backward with ``create_graph=True`` raises); saved for
        backward: ``x`` only.

    Raises:
        TypeError: ``x`` is not a floating tensor of a supported dtype.
        ValueError: the last dim is odd or zero.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"swiglu takes a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"swiglu takes float16, bfloat16 or float32, got {x.dtype}; cast the input")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"swiglu needs a last dim of 2 * I (gate then up), got shape {tuple(x.shape)}"
        )
    if x.device.type == "cuda" or _interpreting():
        return _SwiGLUFn.apply(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


__all__ = ["swiglu"]
