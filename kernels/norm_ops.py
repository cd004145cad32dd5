"""Fused residual add + RMSNorm: ``h = residual + x``, ``y = h / rms(h) * weight``.

Layers: jit kernels -> launchers -> private ``autograd.Function`` -> public :func:`add_rms_norm`.

In a pre-norm block the residual stream (float32 under autocast) gets a 16-bit branch output
added, is normalised, and the result is cast to 16 bits for the next GEMM; the backward runs
the norm's gradient, casts, and adds the residual gradient. In PyTorch that is about ten
memory-bound kernels per norm (forward + backward 0.52 ms at 16k x 1536 on an H200, against
0.22 ms here; ``benchmarks/fused_ops.py``, 48 norms per 760M step). Here it is one kernel
each way: the forward reads ``x`` and ``residual`` and writes ``h`` and ``y`` (in the dtype
the next GEMM wants); the backward reads ``h`` and the two incoming gradients and writes both
input gradients, with the weight gradient reduced per program. Only ``h`` is saved. On tensors that are not on CUDA, without ``TRITON_INTERPRET=1``,
the same math runs as PyTorch ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .forgetting_attention import _interpreting

MAX_WIDTH = 8192
"""Widest row the kernels take (a whole row lives in registers); wider rows use PyTorch."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Private tuning hook (like pro_ops._CONFIG_OVERRIDE): "fwd_elems"/"bwd_elems" (rows * padded
# width per program), "fwd_warps"/"bwd_warps", "bwd_programs_per_sm".
_CONFIG_OVERRIDE: dict[str, int] = {}


@triton.jit
def _add_rms_norm_fwd_kernel(
    X, R, W, Y, H, M, N, stride_x, stride_r, stride_y, stride_h, eps,
    BM: tl.constexpr, BN: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.arange(0, BN)
    col_ok = cols < N
    ok = (rows < M)[:, None] & col_ok[None, :]
    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        h_out = (r.to(tl.float32) + h).to(H.dtype.element_ty)
        tl.store(H + rows[:, None] * stride_h + cols[None, :], h_out, mask=ok)
        h = h_out.to(tl.float32)  # normalise the stream as stored (rounded to its dtype)
    # The weight in the stream's dtype, as the PyTorch norm applies it.
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(H.dtype.element_ty).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / N + eps)
    y = h * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_bwd_kernel(
    H, W, DY, DH, DR, DX, DW, M, N, stride_h, stride_dy, stride_dh, stride_dr, stride_dx, eps,
    BM: tl.constexpr, BN: tl.constexpr, HAS_DH: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """Persistent: program p takes row blocks p, p + P, ... and writes one weight-gradient
    partial row ``DW[p]``."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BN)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(H.dtype.element_ty).to(tl.float32)
    dw = tl.zeros([BN], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BM), n_prog):
        rows = (block * BM + tl.arange(0, BM)).to(tl.int64)
        ok = (rows < M)[:, None] & col_ok[None, :]
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=ok, other=0.0)
        h = h.to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0)
        dy = dy.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / N + eps)
        n = h * rstd[:, None]
        g = dy * w[None, :]
        dw += tl.sum(dy * n, 0)
        # d/dh of h * rstd(h): rstd * (g - n * mean(g * n))
        dh = rstd[:, None] * (g - n * (tl.sum(g * n, 1) / N)[:, None])
        if HAS_DH:
            dh_in = tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=ok, other=0.0)
            dh += dh_in.to(tl.float32)
        if HAS_RES:
            tl.store(
                DR + rows[:, None] * stride_dr + cols[None, :],
                dh.to(DR.dtype.element_ty),
                mask=ok,
            )
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :], dh.to(DX.dtype.element_ty), mask=ok
        )
    tl.store(DW + pid * N + cols, dw, mask=col_ok)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch(n: int, kind: str) -> tuple[int, int, int]:
    """``(BN, BM, num_warps)``: padded width, rows per program and warps."""
    bn = triton.next_power_of_2(n)
    if _interpreting():
        elems, warps = 16 * bn, 4  # few, large programs: the interpreter pays per program
    else:
        # At most ~32 float32 values per thread and live tensor (no spills up to MAX_WIDTH).
        elems = 4096
        warps = max(4 if kind == "fwd" else 8, min(32, bn // 256))
    elems = _CONFIG_OVERRIDE.get(f"{kind}_elems", elems)
    warps = _CONFIG_OVERRIDE.get(f"{kind}_warps", warps)
    return bn, triton.next_power_of_2(max(1, min(64, elems // bn))), warps


def _fwd(x2, r2, w, eps, out_dtype, h_dtype):
    M, N = x2.shape
    bn, bm, warps = _launch(N, "fwd")
    y = torch.empty((M, N), dtype=out_dtype, device=x2.device)
    h = torch.empty((M, N), dtype=h_dtype, device=x2.device) if r2 is not None else x2
    _add_rms_norm_fwd_kernel[(triton.cdiv(M, bm),)](
        x2,
        r2 if r2 is not None else x2,
        w,
        y,
        h,
        M,
        N,
        x2.stride(0),
        r2.stride(0) if r2 is not None else 0,
        y.stride(0),
        h.stride(0),
        eps,
        BM=bm,
        BN=bn,
        HAS_RES=r2 is not None,
        num_warps=warps,
    )
    return y, h


def _bwd(h, w, dy, dh, eps, x_dtype, r_dtype):
    M, N = h.shape
    bn, bm, warps = _launch(N, "bwd")
    n_blocks = triton.cdiv(M, bm)
    if _interpreting() or h.device.type != "cuda":
        n_prog = min(n_blocks, 2)  # still more than one block per program in tests
    else:
        per_sm = _CONFIG_OVERRIDE.get("bwd_programs_per_sm", 2)
        n_prog = min(n_blocks, per_sm * _sm_count(h.device.index or 0))
    n_prog = max(n_prog, 1)
    dx = torch.empty((M, N), dtype=x_dtype, device=h.device)
    dr = torch.empty((M, N), dtype=r_dtype, device=h.device) if r_dtype is not None else dx
    dw_part = torch.empty((n_prog, N), dtype=torch.float32, device=h.device)
    _add_rms_norm_bwd_kernel[(n_prog,)](
        h,
        w,
        dy,
        dh if dh is not None else dy,
        dr,
        dx,
        dw_part,
        M,
        N,
        h.stride(0),
        dy.stride(0),
        dh.stride(0) if dh is not None else 0,
        dr.stride(0),
        dx.stride(0),
        eps,
        BM=bm,
        BN=bn,
        HAS_DH=dh is not None,
        HAS_RES=r_dtype is not None,
        num_warps=warps,
    )
    return dx, (dr if r_dtype is not None else None), dw_part.sum(0)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit column stride (a view when the layout allows it)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _AddRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, out_dtype):
        shape = x.shape
        h_dtype = residual.dtype if residual is not None else x.dtype
        x2 = _rows(x)
        r2 = _rows(residual) if residual is not None else None
        y, h = _fwd(x2, r2, weight, eps, out_dtype, h_dtype)
        ctx.save_for_backward(h, weight)
        ctx.set_materialize_grads(False)  # an unused h (the last norm) sends no gradient
        ctx.eps = eps
        ctx.shape = shape
        ctx.dtypes = (x.dtype, residual.dtype if residual is not None else None)
        if residual is None:
            return y.view(shape)
        return y.view(shape), h.view(shape)

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight = ctx.saved_tensors
        x_dtype, r_dtype = ctx.dtypes
        dy2 = _rows(dy) if dy is not None else torch.zeros_like(h)
        dh2 = _rows(dh) if dh is not None else None
        dx, dr, dw = _bwd(h, weight, dy2, dh2, ctx.eps, x_dtype, r_dtype)
        dw = dw.to(weight.dtype) if ctx.needs_input_grad[2] else None
        dr = dr.view(ctx.shape) if dr is not None else None
        return dx.view(ctx.shape), dr, dw, None, None


def _add_rms_norm_torch(x, residual, weight, eps, out_dtype):
    """The same function as PyTorch ops (the model's composition, float32 norm math)."""
    h = x if residual is None else residual + x
    with torch.autocast(h.device.type, enabled=False):
        y = F.rms_norm(h, (h.shape[-1],), weight.to(h.dtype), eps)
    return y.to(out_dtype), h


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm in one kernel each way: ``(y, h)``.

    ``h = residual + x`` (in float32, rounded once to ``residual``'s dtype; ``h = x`` when
    ``residual`` is None) and ``y = h / sqrt(mean(h^2) + eps) * weight`` with float32 math, the
    weight first rounded to ``h``'s dtype (as the model's PyTorch norm applies it) and one
    rounding to ``out_dtype``. This is the PyTorch composition ``h = residual + x; y =
    F.rms_norm(h, ..., weight.to(h.dtype), eps).to(out_dtype)`` up to the order of the float32
    sum of squares.

    Args:
        x: ``[..., N]`` float16/bfloat16/float32, e.g. a block's output (or the embeddings).
        residual: same shape, any of those dtypes (float32 for a float32 residual stream under
            autocast), or None.
        weight: ``[N]`` norm weight, any float dtype.
        eps: added to the mean square.
        out_dtype: dtype of ``y`` (e.g. bfloat16 when the next GEMM runs in it); default
            ``h``'s dtype.

    Returns:
        ``y`` in ``out_dtype`` and ``h`` (``residual``'s dtype, or ``x`` itself when
        ``residual`` is None), both ``[..., N]``. Differentiable in x, residual and weight
        (float32 reduction, then the weight's dtype). Saved for backward: ``h`` only. Triton
        on CUDA (or under ``TRITON_INTERPRET=1``) for ``N <= MAX_WIDTH``; PyTorch ops elsewhere.

    Raises:
        TypeError / ValueError: on malformed inputs (naming the argument and what to change).
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or x.dim() == 0:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float16/bfloat16/float32 tensor [..., N], got {got}")
    N = x.shape[-1]
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dtype not in _DTYPES:
            got = residual.dtype if isinstance(residual, torch.Tensor) else type(residual).__name__
            raise TypeError(
                f"residual must be a float16/bfloat16/float32 tensor or None, got {got}"
            )
        if residual.shape != x.shape:
            raise ValueError(
                f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; they "
                "are added elementwise"
            )
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}; move it")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"weight must be a floating tensor [N] = [{N}]")
    if tuple(weight.shape) != (N,):
        raise ValueError(f"weight must have shape [{N}] (x's last dim), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}; move it")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    h_dtype = residual.dtype if residual is not None else x.dtype
    out_dtype = out_dtype or h_dtype
    if out_dtype not in _DTYPES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    use_kernel = (x.device.type == "cuda" or _interpreting()) and 0 < N <= MAX_WIDTH
    if not use_kernel or x.numel() == 0:
        return _add_rms_norm_torch(x, residual, weight, eps, out_dtype)
    out = _AddRMSNormFn.apply(x, residual, weight.contiguous(), float(eps), out_dtype)
    return (out, x) if residual is None else out


__all__ = ["MAX_WIDTH", "add_rms_norm"]
