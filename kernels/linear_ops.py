"""Bias-free linear layers with float32 master weights under autocast.

Under ``torch.autocast``, ``F.linear(x, torch.cat([w1, w2, ...]))`` with float32 weights
casts each weight to 16 bits (one kernel per weight), concatenates the casts (another copy),
and in backward computes the weight gradient in 16 bits, splits it and casts every piece
back to float32 (one kernel per weight). :func:`mixed_precision_linear` casts all weights
into one 16-bit buffer with one ``_foreach_copy_`` launch and gets the float32 weight
gradients straight from the GEMM (cuBLAS with a float32 output): fewer launches, fewer bytes,
and weight gradients that were never rounded to 16 bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .checks import differentiable_once
from .decode import _bmm_fp32

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


__all__ = ["mixed_precision_linear"]
