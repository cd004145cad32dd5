"""Bias-free linear layers with float32 master weights under autocast.

Under ``torch.autocast``, ``F.linear(x, torch.cat([w1, w2, ...]))`` with float32 weights
casts each weight to 16 bits (one kernel per weight), concatenates the casts (another copy),
and in backward computes the weight gradient in 16 bits, splits it and casts every piece
back to float32 (one kernel per weight). :func:`mixed_precision_linear` casts all weights
into one 16-bit buffer with one ``_foreach_copy_`` launch and gets the float32 weight
gradients straight from the GEMM (cuBLAS with a float32 output): fewer launches, fewer bytes,
and weight gradients that were never rounded to 16 bits.

:func:`few_rows_linear` is the inference side: a few rows (a decode step) times several
weights in one Triton launch that reads each weight once, where one cuBLAS GEMM needs the
weights concatenated first (a copy of them all, every step) and one GEMM per weight costs a
launch each. :func:`few_rows_logsigmoid_linear` is a decode step's forget gate (a float32
projection and its log-sigmoid) in one launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import differentiable_once, needs_grad, on_input_gpu
from .decode import _bmm_fp32
from .forgetting_attention import _interpreting

_HALF = (torch.float16, torch.bfloat16)


class _MixedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype, *weights):
        sizes = [w.shape[0] for w in weights]
        if len(weights) == 1:
            w16 = weights[0].to(dtype)
        else:
            w16 = torch.empty((sum(sizes), weights[0].shape[1]), dtype=dtype, device=x.device)
            torch._foreach_copy_(list(w16.split(sizes)), list(weights))
        x16 = x.to(dtype)
        ctx.save_for_backward(x16, w16)
        ctx.sizes, ctx.x_dtype = sizes, x.dtype
        return F.linear(x16, w16)

    @staticmethod
    @differentiable_once(
        "mixed_precision_linear",
        "Use F.linear(x.to(dtype), torch.cat(weights).to(dtype)), which has one (in a fot model, attn_backend='reference' and loss_impl='chunked').",
    )
    def backward(ctx, dy):
        x16, w16 = ctx.saved_tensors
        dy = dy.to(w16.dtype)
        dx = (dy @ w16).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):
            return dx, None, *([None] * len(ctx.sizes))
        m = math.prod(dy.shape[:-1])  # not reshape(-1, ...): N or K may be 0
        dy2 = dy.reshape(m, dy.shape[-1])  # (M, N)
        x2 = x16.reshape(m, x16.shape[-1])  # (M, K)
        dw = _bmm_fp32(dy2.t()[None], x2[None])[0]  # (N, K) float32, never rounded to 16 bits
        return dx, None, *dw.split(ctx.sizes)


def mixed_precision_linear(
    x: torch.Tensor, weights: Sequence[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """``F.linear(x.to(dtype), torch.cat(weights).to(dtype))`` with float32 weight gradients.

    The forward equals autocast's (the same 16-bit operands and GEMM). The backward returns
    the weight gradients in float32 computed from the 16-bit operands with float32
    accumulation and a float32 result (cuBLAS on CUDA; a float32 matmul of the rounded
    operands elsewhere), where autocast rounds them to 16 bits first.

    Args:
        x: ``[..., K]`` floating input (any float dtype; cast to ``dtype``).
        weights: one or more ``[N_i, K]`` float32 weights (e.g. q, k and v projections).
        dtype: ``torch.bfloat16`` or ``torch.float16``, the GEMM dtype (autocast's).

    Returns:
        ``[..., sum N_i]`` in ``dtype``, the layers' outputs side by side in ``weights``
        order. Gradients: x in x's dtype, each weight in float32; differentiable once (a
        backward with ``create_graph=True`` raises).

    Raises:
        ValueError / TypeError: on an empty ``weights``, a non-float32 or mismatched weight,
        or a ``dtype`` that is not 16-bit.
    """
    if dtype not in _HALF:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating tensor [..., K], got {got}")
    if not isinstance(weights, Sequence):
        raise TypeError(
            f"weights must be a list or tuple of [N, K] weights, got {type(weights).__name__}; "
            "wrap a single weight as [w]"
        )
    if not weights:
        raise ValueError("weights is empty; pass at least one [N, K] weight")
    k = x.shape[-1]
    for i, w in enumerate(weights):
        if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] != k:
            raise TypeError(
                f"weights[{i}] must be a float32 [N, {k}] matrix (x has {k} features), got "
                f"{w.dtype} {tuple(w.shape)}; use F.linear for other weights"
            )
        if w.device != x.device:
            raise ValueError(f"weights[{i}] is on {w.device} but x is on {x.device}; move it")
    return _MixedLinearFn.apply(x, dtype, *weights)


FEW_ROWS = 16
"""Most rows :func:`few_rows_linear` takes (one tile of the tensor cores' smallest shape)."""
MAX_WEIGHTS = 8
"""Most weights :func:`few_rows_linear` takes in one launch."""


@triton.jit
def _pick(pid, blk, W, C, N, cur_w, cur_b, cur_c, cur_n):
    """A layer's weight, first block, first output column and width if ``pid`` lies in or
    after its blocks (the layers' blocks are consecutive), else the current ones."""
    if pid >= blk:
        cur_w, cur_b, cur_c, cur_n = W, blk, C, N
    return cur_w, cur_b, cur_c, cur_n


GPU_TILES_FEW_ROWS = (32, 128)
"""``few_rows_linear``'s launch on a GPU: output columns and K per tile (4 warps, 4 stages).
32 x 128 was the fastest or within 0.4 us of it for the 760M model's fused input projections
on an H100 and an H200 (``benchmarks/fused_ops.py --decode-projections``; docs/benchmarks.md,
"32 x 128 few-row tiles"). Float32 rows at these tiles ask for 73,728 bytes of shared memory."""

GPU_TILES_LOGSIGMOID = (1, 1024, 8)
"""``few_rows_logsigmoid_linear``'s launch on a GPU: outputs per program, K tile, warps. One
output per program was the fastest of 48 settings on an H100 (docs/benchmarks.md, "one gate
output per program")."""


@triton.jit
def _few_rows_kernel(
    X, Y, W0, W1, W2, W3, W4, W5, W6, W7,
    B1, B2, B3, B4, B5, B6, B7, C1, C2, C3, C4, C5, C6, C7,
    N0, N1, N2, N3, N4, N5, N6, N7,
    M, K, stride_xm, stride_ym,
    NW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """``Y[:, C_l + n] = X @ W_l[n, :]`` for the ``BN`` output columns of program ``pid``.

    The columns of layer ``l`` are blocks ``B_l ..`` (``B_0 = 0``), its outputs start at
    column ``C_l`` (``C_0 = 0``), it has ``N_l`` rows ``[N_l, K]`` (contiguous). ``X`` is
    ``[M, K]`` with ``M <= BM``; float32 accumulation.
    """
    pid = tl.program_id(0)
    w, b0, c0, n = W0, 0, 0, N0
    if NW > 1:
        w, b0, c0, n = _pick(pid, B1, W1, C1, N1, w, b0, c0, n)
    if NW > 2:
        w, b0, c0, n = _pick(pid, B2, W2, C2, N2, w, b0, c0, n)
    if NW > 3:
        w, b0, c0, n = _pick(pid, B3, W3, C3, N3, w, b0, c0, n)
    if NW > 4:
        w, b0, c0, n = _pick(pid, B4, W4, C4, N4, w, b0, c0, n)
    if NW > 5:
        w, b0, c0, n = _pick(pid, B5, W5, C5, N5, w, b0, c0, n)
    if NW > 6:
        w, b0, c0, n = _pick(pid, B6, W6, C6, N6, w, b0, c0, n)
    if NW > 7:
        w, b0, c0, n = _pick(pid, B7, W7, C7, N7, w, b0, c0, n)
    rows = tl.arange(0, BM)
    cols = (pid - b0) * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(
            X + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # fmt: skip
        wt = tl.load(
            w + cols[None, :].to(tl.int64) * K + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # (BK, BN): W's rows as columns
        acc += tl.dot(x, wt, input_precision=DOT_PREC)
    tl.store(
        Y + rows[:, None] * stride_ym + c0 + cols[None, :],
        acc.to(Y.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def few_rows_linear_supported(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`few_rows_linear` takes ``x`` and ``weights``: at most
    :data:`FEW_ROWS` rows and :data:`MAX_WEIGHTS` weights, one 16/32-bit dtype, one device
    (CUDA, or the interpreter), contiguous ``[N, K]`` weights with ``K >= 1``, and nothing
    to differentiate (it has no backward), autocast off."""
    if not weights or len(weights) > MAX_WEIGHTS or x.dim() == 0:
        return False
    if x.dtype not in (*_HALF, torch.float32) or not (x.is_cuda or _interpreting()):
        return False
    if x.numel() > FEW_ROWS * x.shape[-1] or torch.is_autocast_enabled(x.device.type):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    k = x.shape[-1]
    return k > 0 and all(
        w.dtype == x.dtype and w.device == x.device and w.dim() == 2 and w.shape[1] == k
        and w.is_contiguous()
        for w in weights
    )  # fmt: skip


@on_input_gpu
def few_rows_linear(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, torch.cat(weights))`` for a few rows, without concatenating the weights.

    One launch reads each weight once (a decode step's GEMMs are bound by reading the
    weights); float32 accumulation, as cuBLAS. Inference only: no autograd.

    Args:
        x: ``[..., K]`` float16/bfloat16/float32 with at most :data:`FEW_ROWS` rows
            (``x.numel() / K``), on CUDA (or under Triton's interpreter).
        weights: 1 to :data:`MAX_WEIGHTS` contiguous ``[N_i, K]`` weights of x's dtype and
            device.

    Returns:
        ``[..., sum N_i]`` in x's dtype, the outputs side by side in ``weights`` order.

    Raises:
        ValueError: inputs :func:`few_rows_linear_supported` refuses.
    """
    if not few_rows_linear_supported(x, weights):
        raise ValueError(
            f"few_rows_linear takes at most {FEW_ROWS} rows and {MAX_WEIGHTS} contiguous [N, "
            "K] weights of x's 16/32-bit dtype on x's CUDA device, outside autocast and "
            f"autograd; got x {x.dtype} {tuple(x.shape)} on {x.device} and "
            f"{[(w.dtype, tuple(w.shape)) for w in weights]}: use F.linear(x, torch.cat(weights))"
        )
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    sizes = [w.shape[0] for w in weights]
    y = torch.empty(x2.shape[0], sum(sizes), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y.view(*x.shape[:-1], y.shape[-1])
    BN, BK = GPU_TILES_FEW_ROWS if not _interpreting() else (32, 64)
    blocks = [triton.cdiv(n, BN) for n in sizes]
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    cols = [sum(sizes[:i]) for i in range(len(sizes))]
    out = y
    ws = list(weights)
    if _interpreting() and x.dtype == torch.bfloat16:
        # The interpreter's tl.dot multiplies raw bf16 bit patterns (DESIGN.md §4): float32.
        x2, ws, y = x2.float(), [w.float() for w in ws], y.float()
    pad = MAX_WEIGHTS - len(ws)
    ws += [ws[0]] * pad
    _few_rows_kernel[(sum(blocks),)](
        x2, y, *ws, *(starts[1:] + [0] * pad), *(cols[1:] + [0] * pad), *(sizes + [0] * pad),
        x2.shape[0], K, x2.stride(0), y.stride(0),
        NW=len(weights), BM=FEW_ROWS, BN=BN, BK=BK,
        DOT_PREC="ieee" if x2.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=4,
    )  # fmt: skip
    if y is not out:
        out.copy_(y)
    return out.view(*x.shape[:-1], out.shape[-1])


@triton.jit
def _few_rows_logsigmoid_kernel(
    X, W, Bias, Y, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``Y[m, n] = log sigmoid(X[m] . W[n] + Bias[n])`` in float32 for row ``m =
    program_id(1)`` and the ``BN`` columns of ``program_id(0)``; ``W`` ``[N, K]`` contiguous."""
    m = tl.program_id(1)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    col_ok = cols < N
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(X + m * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            W + cols[:, None].to(tl.int64) * K + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BN, BK)
        acc += w * x[None, :]
    z = tl.sum(acc, axis=1)  # (BN,)
    if HAS_BIAS:
        z += tl.load(Bias + cols, mask=col_ok, other=0.0)
    # log sigmoid(z) = min(z, 0) - log1p(exp(-|z|)); log1p(e) = log(u) * e / (u - 1) with
    # u = 1 + e keeps its relative precision where e is far below 1 (Goldberg's form).
    e = tl.exp(-tl.abs(z))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    tl.store(Y + m * stride_ym + cols, tl.minimum(z, 0.0) - log1p, mask=col_ok)


def few_rows_logsigmoid_linear_supported(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Whether :func:`few_rows_logsigmoid_linear` takes its arguments: at most
    :data:`FEW_ROWS` rows of a 16/32-bit ``x`` on CUDA (or the interpreter), a contiguous
    float32 ``[N, K]`` weight (``K >= 1``) and float32 ``[N]`` bias (or None) on x's device,
    and nothing to differentiate (it has no backward)."""
    if x.dtype not in (*_HALF, torch.float32) or not (x.is_cuda or _interpreting()):
        return False
    if x.dim() == 0 or x.shape[-1] == 0 or x.numel() > FEW_ROWS * x.shape[-1]:
        return False
    if needs_grad(x, weight, bias):
        return False
    ok = (
        weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
        and weight.shape[1] == x.shape[-1] and weight.device == x.device
    )  # fmt: skip
    if bias is not None:
        ok = ok and bias.dtype == torch.float32 and bias.shape == (weight.shape[0],)
        ok = ok and bias.is_contiguous() and bias.device == x.device
    return ok


@on_input_gpu
def few_rows_logsigmoid_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.logsigmoid(F.linear(x.float(), weight, bias))`` for a few rows, in one launch.

    A decode step's forget gate (a float32 ``[HQ, hidden]`` projection of a 16-bit hidden
    state): PyTorch spends a cast of ``x``, a GEMV, its reduction and the log-sigmoid on it,
    four launches per layer. Float32 products and sums; inference only (no autograd).

    Args:
        x: ``[..., K]`` float16/bfloat16/float32 with at most :data:`FEW_ROWS` rows
            (``x.numel() / K``), on CUDA (or under Triton's interpreter).
        weight: ``[N, K]`` float32, contiguous, on x's device.
        bias: ``[N]`` float32 on x's device, or None.

    Returns:
        ``[..., N]`` float32 log sigmoid of the logits.

    Raises:
        ValueError: inputs :func:`few_rows_logsigmoid_linear_supported` refuses.
    """
    if not few_rows_logsigmoid_linear_supported(x, weight, bias):
        raise ValueError(
            f"few_rows_logsigmoid_linear takes at most {FEW_ROWS} rows of a 16/32-bit x on a "
            "CUDA device, a contiguous float32 [N, K] weight and a float32 [N] bias (or None) "
            f"on x's device, outside autograd; got x {x.dtype} {tuple(x.shape)} on {x.device}, "
            f"weight {weight.dtype} {tuple(weight.shape)}, bias "
            f"{None if bias is None else (bias.dtype, tuple(bias.shape))}: use "
            "F.logsigmoid(F.linear(x.float(), weight, bias))"
        )
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y.view(*x.shape[:-1], N)
    # the interpreter pays per program: 4 outputs per program there
    BN, BK, warps = GPU_TILES_LOGSIGMOID if not _interpreting() else (4, 32, 4)
    _few_rows_logsigmoid_kernel[(triton.cdiv(N, BN), x2.shape[0])](
        x2, weight, bias if bias is not None else weight, y, N, K, x2.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BN=BN, BK=BK, num_warps=warps,
    )  # fmt: skip
    return y.view(*x.shape[:-1], N)


__all__ = [
    "few_rows_linear",
    "few_rows_linear_supported",
    "few_rows_logsigmoid_linear",
    "few_rows_logsigmoid_linear_supported",
    "mixed_precision_linear",
]
