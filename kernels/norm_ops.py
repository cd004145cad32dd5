"""Fused residual add + RMSNorm: ``h = residual + x``, ``y = h / rms(h) * weight``.

Layers: jit kernels -> launchers -> private ``autograd.Function`` -> public :func:`add_rms_norm`.

In a pre-norm block the residual stream (float32 under autocast) gets a 16-bit branch output
added, is normalised, and the result is cast to 16 bits for the next GEMM; the backward runs
the norm's gradient, casts, and adds the residual gradient. In PyTorch that is about ten
memory-bound kernels per norm (forward + backward 0.52 ms at 16k x 1536 on an H200, against
0.22 ms here; ``benchmarks/fused_ops.py``, 48 norms per 760M step). Here it is one kernel
each way: the forward reads ``x`` and ``residual`` and writes ``h`` and ``y`` (in the dtype
the next GEMM wants); the backward reads ``h`` and the two incoming gradients and writes both
input gradients, with the weight gradient reduced per program. Only ``h`` is saved.

FoT's forget gate reads the attention block's normalised input in float32 (a ``[K = heads,
N]`` projection). Without help that costs a float32 ``y``, its cast for the GEMMs, a float32
GEMM each way, a saved float32 copy and a float32 gradient add. With ``proj_weight`` the
forward writes ``y`` in 16 bits only, plus each row's ``rstd``, and takes the logits from the
float32 ``h`` it wrote anyway (``z = rstd * (h @ (PW * w)^T) + b``, one small GEMM); the
backward kernel reads ``dz @ PW`` (one small GEMM) beside the 16-bit ``dy`` instead of a
float32 sum of the two, and PW's gradient is one small GEMM over the saved ``h``.

On tensors that are not on CUDA, without ``TRITON_INTERPRET=1``, the same math runs as
PyTorch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import differentiable_once, on_input_gpu, sm_count
from .forgetting_attention import _interpreting

MAX_WIDTH = 8192
"""Widest row the kernels take (a whole row lives in registers); wider rows use PyTorch."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Private tuning hook (like pro_ops._CONFIG_OVERRIDE): "fwd_elems"/"bwd_elems" (rows * padded
# width per program), "fwd_warps"/"bwd_warps", "bwd_programs_per_sm".
_CONFIG_OVERRIDE: dict[str, int] = {}


@triton.jit
def _add_rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD, M, N, stride_x, stride_r, stride_y, stride_h, eps,
    BM: tl.constexpr, BN: tl.constexpr, HAS_RES: tl.constexpr, STORE_RSTD: tl.constexpr,
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
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=rows < M)


@triton.jit
def _add_rms_norm_bwd_kernel(
    H, W, DY, DY2, DH, DR, DX, DW, M, N, stride_h, stride_dy, stride_dy2, stride_dh,
    stride_dr, stride_dx, eps,
    BM: tl.constexpr, BN: tl.constexpr, HAS_DY2: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_RES: tl.constexpr,
):  # fmt: skip
    """Persistent: program p takes row blocks p, p + P, ... and writes one weight-gradient
    partial row ``DW[p]``. ``DY2`` (the projection's share of y's gradient) adds to ``DY``."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BN)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(H.dtype.element_ty).to(tl.float32)
    dw = tl.zeros([BN], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BM), n_prog):
        rows = (block * BM + tl.arange(0, BM)).to(tl.int64)
        ok = (rows < M)[:, None] & col_ok[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0)
        dy = dy.to(tl.float32)
        if HAS_DY2:
            dy2 = tl.load(DY2 + rows[:, None] * stride_dy2 + cols[None, :], mask=ok, other=0.0)
            dy += dy2.to(tl.float32)
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=ok, other=0.0)
        h = h.to(tl.float32)
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


def _fwd(x2, r2, w, eps, out_dtype, h_dtype, store_rstd):
    M, N = x2.shape
    bn, bm, warps = _launch(N, "fwd")
    y = torch.empty((M, N), dtype=out_dtype, device=x2.device)
    h = torch.empty((M, N), dtype=h_dtype, device=x2.device) if r2 is not None else x2
    rstd = torch.empty((M,), dtype=torch.float32, device=x2.device) if store_rstd else None
    _add_rms_norm_fwd_kernel[(triton.cdiv(M, bm),)](
        x2,
        r2 if r2 is not None else x2,
        w,
        y,
        h,
        rstd if store_rstd else y,
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
        STORE_RSTD=store_rstd,
        num_warps=warps,
    )
    return y, h, rstd


def _bwd(h, w, dy, dy2, dh, eps, x_dtype, r_dtype):
    M, N = h.shape
    bn, bm, warps = _launch(N, "bwd")
    n_blocks = triton.cdiv(M, bm)
    if _interpreting() or h.device.type != "cuda":
        n_prog = min(n_blocks, 2)  # still more than one block per program in tests
    else:
        per_sm = _CONFIG_OVERRIDE.get("bwd_programs_per_sm", 2)
        n_prog = min(n_blocks, per_sm * sm_count(h.device.index or 0))
    n_prog = max(n_prog, 1)
    dx = torch.empty((M, N), dtype=x_dtype, device=h.device)
    dr = torch.empty((M, N), dtype=r_dtype, device=h.device) if r_dtype is not None else dx
    dw_part = torch.empty((n_prog, N), dtype=torch.float32, device=h.device)
    _add_rms_norm_bwd_kernel[(n_prog,)](
        h,
        w,
        dy,
        dy2 if dy2 is not None else dy,
        dh if dh is not None else dy,
        dr,
        dx,
        dw_part,
        M,
        N,
        h.stride(0),
        dy.stride(0),
        dy2.stride(0) if dy2 is not None else 0,
        dh.stride(0) if dh is not None else 0,
        dr.stride(0),
        dx.stride(0),
        eps,
        BM=bm,
        BN=bn,
        HAS_DY2=dy2 is not None,
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
    def forward(ctx, x, residual, weight, eps, out_dtype, proj_weight, proj_bias):
        shape = x.shape
        h_dtype = residual.dtype if residual is not None else x.dtype
        x2 = _rows(x)
        r2 = _rows(residual) if residual is not None else None
        proj = proj_weight is not None
        y, h, rstd = _fwd(x2, r2, weight, eps, out_dtype, h_dtype, proj)
        outs = [y.view(shape)]
        if residual is not None:
            outs.append(h.view(shape))
        if proj:
            # y = h * rstd * w, so z = rstd * (h @ (PW * w)^T) + b: one float32 GEMM over the
            # float32 h already in memory (no float32 y to write, cast or save).
            with torch.autocast(h.device.type, enabled=False):
                z = h @ (proj_weight.float() * weight.to(h.dtype)[None, :]).t()  # (M, K)
                z.mul_(rstd[:, None])
                if proj_bias is not None:
                    z.add_(proj_bias.float())
            outs.append(z.view(*shape[:-1], z.shape[-1]))
        ctx.save_for_backward(h, weight, proj_weight, rstd)
        ctx.set_materialize_grads(False)  # an unused h (the last norm) sends no gradient
        ctx.eps = eps
        ctx.shape = shape
        ctx.dtypes = (x.dtype, residual.dtype if residual is not None else None)
        ctx.proj_bias_dtype = proj_bias.dtype if proj_bias is not None else None
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    @differentiable_once(
        "add_rms_norm",
        "Use residual + x and F.rms_norm (and F.linear), which have one (in a fot model, attn_backend='reference' and loss_impl='chunked').",
    )
    def backward(ctx, dy, *more):
        h, weight, proj_weight, rstd = ctx.saved_tensors
        x_dtype, r_dtype = ctx.dtypes
        dh = more[0] if r_dtype is not None else None
        dz = more[-1] if proj_weight is not None else None
        dy2 = _rows(dy) if dy is not None else torch.zeros_like(h)
        dh2 = _rows(dh) if dh is not None else None
        dz2 = _rows(dz).float() if dz is not None else None
        dy_proj = None
        if dz2 is not None:  # z's share of y's gradient: one float32 GEMM, added in the kernel
            with torch.autocast(h.device.type, enabled=False):
                dy_proj = dz2 @ proj_weight.float()  # (M, N)
        dx, dr, dw = _bwd(h, weight, dy2, dy_proj, dh2, ctx.eps, x_dtype, r_dtype)
        dw = dw.to(weight.dtype) if ctx.needs_input_grad[2] else None
        dr = dr.view(ctx.shape) if dr is not None else None
        dpw = dpb = None
        if dz2 is not None:
            # dPW = dz^T @ y = ((dz * rstd)^T @ h) * w: one GEMM over the saved h.
            with torch.autocast(h.device.type, enabled=False):
                if ctx.needs_input_grad[5]:
                    dpw = ((dz2 * rstd[:, None]).t() @ h) * weight.to(h.dtype)[None, :]
                    dpw = dpw.to(proj_weight.dtype)
                if ctx.proj_bias_dtype is not None and ctx.needs_input_grad[6]:
                    dpb = dz2.sum(0).to(ctx.proj_bias_dtype)
        return dx.view(ctx.shape), dr, dw, None, None, dpw, dpb


def _add_rms_norm_torch(x, residual, weight, eps, out_dtype, proj_weight=None, proj_bias=None):
    """The same function as PyTorch ops (the model's composition, float32 norm math)."""
    h = x if residual is None else residual + x
    z = None
    with torch.autocast(h.device.type, enabled=False):
        y = F.rms_norm(h, (h.shape[-1],), weight.to(h.dtype), eps)
        if proj_weight is not None:
            pb = proj_bias.float() if proj_bias is not None else None
            z = F.linear(y, proj_weight.float(), pb)
    return y.to(out_dtype), h, z


@on_input_gpu
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    proj_weight: torch.Tensor | None = None,
    proj_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Residual add and RMSNorm in one kernel each way: ``(y, h)``, or ``(y, h, z)``.

    ``h = residual + x`` (in float32, rounded once to ``residual``'s dtype; ``h = x`` when
    ``residual`` is None) and ``y = h / sqrt(mean(h^2) + eps) * weight`` with float32 math, the
    weight first rounded to ``h``'s dtype (as the model's PyTorch norm applies it) and one
    rounding to ``out_dtype``. This is the PyTorch composition ``h = residual + x; y =
    F.rms_norm(h, ..., weight.to(h.dtype), eps).to(out_dtype)`` up to the order of the float32
    sum of squares.

    With ``proj_weight`` it also returns a narrow float32 projection of the *unrounded* ``y``:
    ``z = F.linear(y, proj_weight, proj_bias)`` in float32 (FoT's forget-gate logits, one per
    head), so that ``y`` itself can leave in 16 bits for the GEMMs while ``z`` sees no 16-bit
    rounding; no float32 ``y`` is written or saved. Needs a float32 stream.

    Args:
        x: ``[..., N]`` float16/bfloat16/float32, e.g. a block's output (or the embeddings).
        residual: same shape, any of those dtypes (float32 for a float32 residual stream under
            autocast), or None.
        weight: ``[N]`` norm weight, any float dtype.
        eps: added to the mean square.
        out_dtype: dtype of ``y`` (e.g. bfloat16 when the next GEMM runs in it); default
            ``h``'s dtype.
        proj_weight: ``[K, N]`` float weight of the projection, or None (no ``z``). Needs
            ``h`` in float32.
        proj_bias: ``[K]`` float bias of the projection, or None.

    Returns:
        ``y`` in ``out_dtype`` and ``h`` (``residual``'s dtype, or ``x`` itself when
        ``residual`` is None), both ``[..., N]``; with ``proj_weight`` also ``z`` ``[..., K]``
        float32. Differentiable in x, residual, weight, proj_weight and proj_bias (float32
        reductions, then each parameter's dtype); once on the Triton path (a backward with
        ``create_graph=True`` raises). Saved for backward: ``h`` (and, with a
        projection, each row's float32 ``rstd``). Triton on CUDA (or under
        ``TRITON_INTERPRET=1``) for ``N <= MAX_WIDTH``; PyTorch ops elsewhere.

    Raises:
        TypeError / ValueError: on malformed inputs (naming the argument and what to change).
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or x.dim() == 0:
        got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
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
    _check_projection(proj_weight, proj_bias, N, h_dtype, x.device)
    use_kernel = (x.device.type == "cuda" or _interpreting()) and 0 < N <= MAX_WIDTH
    if not use_kernel or x.numel() == 0:
        y, h, z = _add_rms_norm_torch(x, residual, weight, eps, out_dtype, proj_weight, proj_bias)
        return (y, h) if z is None else (y, h, z)
    if proj_weight is not None:
        proj_weight = proj_weight.contiguous()
        proj_bias = proj_bias.contiguous() if proj_bias is not None else None
    out = _AddRMSNormFn.apply(
        x, residual, weight.contiguous(), float(eps), out_dtype, proj_weight, proj_bias
    )
    if residual is None:  # h = x: the Function does not return its own input
        return (out, x) if proj_weight is None else (out[0], x, out[1])
    return out


def _check_projection(
    proj_weight: torch.Tensor | None,
    proj_bias: torch.Tensor | None,
    n: int,
    h_dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Raise a clear error for a malformed ``proj_weight`` / ``proj_bias`` of :func:`add_rms_norm`."""
    if proj_weight is None:
        if proj_bias is not None:
            raise ValueError("proj_bias was given without proj_weight; pass both or neither")
        return
    if not isinstance(proj_weight, torch.Tensor) or not proj_weight.is_floating_point():
        raise TypeError(f"proj_weight must be a floating tensor [K, N] with N = {n}")
    if proj_weight.dim() != 2 or proj_weight.shape[1] != n or proj_weight.shape[0] == 0:
        raise ValueError(
            f"proj_weight must have shape [K, {n}] (K >= 1 outputs, x's last dim), got "
            f"{tuple(proj_weight.shape)}"
        )
    k = proj_weight.shape[0]
    if proj_bias is not None:
        if not isinstance(proj_bias, torch.Tensor) or not proj_bias.is_floating_point():
            raise TypeError(f"proj_bias must be a floating tensor [{k}] or None")
        if tuple(proj_bias.shape) != (k,):
            raise ValueError(f"proj_bias must have shape [{k}], got {tuple(proj_bias.shape)}")
    for name, t in (("proj_weight", proj_weight), ("proj_bias", proj_bias)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but x is on {device}; move it")
    if h_dtype != torch.float32:
        raise ValueError(
            f"proj_weight needs a float32 stream (residual, or x without one), got {h_dtype}; "
            "project the norm's output with a separate matmul instead"
        )


__all__ = ["MAX_WIDTH", "add_rms_norm"]
