"""Decode-time forgetting attention: a few new queries against a long K/V cache.

A vectorised PyTorch implementation (one batched matmul for the scores, one for the values,
GQA by grouping query heads instead of copying the cache). Decode is memory-bound (each
cached key and value is read once per step), which batched matmuls already do well; the gate
cumsum of the cache is never recomputed: the caller passes the running c.
"""

from __future__ import annotations

import math

import torch

from .checks import check_decode_inputs


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for half-precision ``[N, M, K] x [N, K, P]`` with an fp32 result.

    On CUDA one cuBLAS call with fp32 output (``out_dtype``, PyTorch >= 2.8): no fp32 copy of
    the operands and no rounding of the products to half precision. Elsewhere (or on older
    PyTorch) the operands are upcast first (same numbers, more memory traffic).
    """
    if a.is_cuda and _HAS_OUT_DTYPE[0]:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):
            _HAS_OUT_DTYPE[0] = False  # remember: do not try again in every decode step
    return torch.bmm(a.float(), b.float())


_HAS_OUT_DTYPE = [True]


def forgetting_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_cumsum: torch.Tensor,
    k_cumsum: torch.Tensor,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Few queries vs cached keys/values; same contract as the decode reference.

    The ``Tq`` queries are the last ``Tq`` positions of the ``Tk`` cached keys: query ``i``
    attends key ``j`` iff ``j <= Tk - Tq + i`` (and ``Tk - Tq + i - j < window_size`` with a
    window, and ``key_mask[b, j]``).

    Args:
        q: ``[B, Tq, HQ, D]`` float16/bfloat16/float32/float64, any device.
        k_cache: ``[B, Tk, H, D]``; ``v_cache`` the same shape; ``HQ % H == 0``.
        q_cumsum: ``[B, Tq, HQ]`` float32/float64 running gate cumsum at the query positions.
        k_cumsum: ``[B, Tk, HQ]`` float32/float64 running gate cumsum at the key positions.
        scale: logit scale; default ``D ** -0.5``.
        window_size: sliding window, as in :func:`forgetting_attention`.
        key_mask: ``[B, Tk]`` bool, False for keys to ignore (left padding).

    Returns:
        ``[B, Tq, HQ, D]`` in q's dtype (float32 softmax inside; float64 for float64 input;
        under autocast too). A query with no visible key gets zeros.
    """
    check_decode_inputs(
        q, k_cache, v_cache, q_cumsum, k_cumsum, key_mask=key_mask, window_size=window_size
    )
    if torch.is_autocast_enabled(q.device.type):
        # autocast would run the float32 matmuls in 16 bits (scores rounded to bf16: 1e-2
        # off); without it the ops are those outside autocast (a 16-bit cache is read as is)
        with torch.autocast(q.device.type, enabled=False):
            return _decode(q, k_cache, v_cache, q_cumsum, k_cumsum, scale, window_size, key_mask)
    return _decode(q, k_cache, v_cache, q_cumsum, k_cumsum, scale, window_size, key_mask)


def _decode(q, k_cache, v_cache, q_cumsum, k_cumsum, scale, window_size, key_mask):
    """:func:`forgetting_attention_decode` on checked inputs, autocast off."""
    B, Tq, HQ, D = q.shape
    Tk, H = k_cache.shape[1], k_cache.shape[2]
    R = HQ // H
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    low = k_cache.dtype in (torch.float16, torch.bfloat16) and v_cache.dtype == k_cache.dtype
    if low and compute == torch.float32:
        # Half-precision cache: never copy it to fp32. The two matmuls read it as is (a view
        # per head when the cache is head-major, as FoTCache keeps it) and accumulate in fp32.
        qg = q.to(k_cache.dtype).reshape(B, Tq, H, R, D).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(B * H, R * Tq, D)  # (B*H, R*Tq, D), small
        kc = k_cache.transpose(1, 2).reshape(B * H, Tk, D)  # (B*H, Tk, D): a view if head-major
        vc = v_cache.transpose(1, 2).reshape(B * H, Tk, D)
        scores = _bmm_fp32(qg, kc.transpose(1, 2)) * scale  # (B*H, R*Tq, Tk) float32
    else:
        qg = q.to(compute).reshape(B, Tq, H, R, D).permute(0, 2, 3, 1, 4)  # (B, H, R, Tq, D)
        kc = k_cache.to(compute).permute(0, 2, 3, 1)  # (B, H, D, Tk)
        vc = v_cache.to(compute).permute(0, 2, 1, 3)  # (B, H, Tk, D)
        scores = torch.matmul(qg.reshape(B, H, R * Tq, D), kc) * scale  # (B, H, R*Tq, Tk)
    scores = scores.view(B, H, R, Tq, Tk)
    # The bias difference in float64: long caches have large |c|, and c_i - c_j must not
    # lose its low bits (only the difference matters).
    cq = q_cumsum.to(torch.float64).reshape(B, Tq, H, R).permute(0, 2, 3, 1)  # (B, H, R, Tq)
    ck = k_cumsum.to(torch.float64).reshape(B, Tk, H, R).permute(0, 2, 3, 1)  # (B, H, R, Tk)
    scores = scores + (cq[..., :, None] - ck[..., None, :]).to(compute)
    q_pos = torch.arange(Tk - Tq, Tk, device=q.device)
    k_pos = torch.arange(Tk, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # (Tq, Tk)
    if window_size is not None:
        allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window_size)
    allowed = allowed.view(1, 1, 1, Tq, Tk)
    if key_mask is not None:
        allowed = allowed & key_mask.view(B, 1, 1, 1, Tk)
    scores = scores.masked_fill(~allowed, float("-inf"))
    # A query with no visible key gives 0 (not NaN); a NaN in the inputs stays NaN.
    empty = ~allowed.any(-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)  # (B, H, R, Tq, Tk)
    if low and compute == torch.float32:
        # probabilities rounded to the cache dtype, as FlashAttention does before P @ V
        out = _bmm_fp32(probs.to(v_cache.dtype).view(B * H, R * Tq, Tk), vc)  # (B*H, R*Tq, D)
    else:
        out = torch.matmul(probs.view(B, H, R * Tq, Tk), vc)  # (B, H, R*Tq, D)
    out = out.view(B, H, R, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq, HQ, D)
    return out.to(q.dtype)


__all__ = ["forgetting_attention_decode"]
