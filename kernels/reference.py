"""Pure-PyTorch forgetting attention: the oracle for tests and the path on CPU.

    c_i = sum_{l<=i} log f_l
    o_i = sum_{j<=i} softmax_j(q_i . k_j * scale + c_i - c_j) v_j

Runs on any device and dtype (float64 included). Queries are processed in chunks so the
largest intermediate is ``[B, HQ, chunk, T]`` rather than ``[B, HQ, T, T]``; under autograd
each chunk is checkpointed, so backward also holds one chunk's scores at a time.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.utils.checkpoint import checkpoint

from .checks import check_decode_inputs, check_inputs


def _gate_cumsum(log_fgate: torch.Tensor) -> torch.Tensor:
    """Cumulative sum of log f over time in float64 (exact enough at any length).

    Args:
        log_fgate: ``[B, T, HQ]`` float32.

    Returns:
        ``[B, T, HQ]`` float64.
    """
    return torch.cumsum(log_fgate.double(), dim=1)


def _attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c_q: torch.Tensor,
    c_k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    window_size: int | None,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk of queries against all keys.

    Shapes: q ``[B, Tq, HQ, D]``, k/v ``[B, Tk, HQ, D]`` (already expanded for GQA),
    c_q ``[B, Tq, HQ]``, c_k ``[B, Tk, HQ]`` (float64), q_pos ``[Tq]``, k_pos ``[Tk]``
    (absolute positions deciding causality), key_mask ``[B, Tk]`` bool (True = attend).
    Returns ``[B, Tq, HQ, D]`` in q's dtype.
    """
    if torch.is_autocast_enabled(q.device.type):
        # autocast would run the einsums in 16 bits (scores rounded to bf16: ~4e-3 off)
        with torch.autocast(q.device.type, enabled=False):
            return _attend_chunk(q, k, v, c_q, c_k, q_pos, k_pos, scale, window_size, key_mask)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (
        torch.einsum("bihd,bjhd->bhij", q.to(compute), k.to(compute)) * scale
    )  # (B, HQ, Tq, Tk)
    bias = (
        c_q.permute(0, 2, 1)[..., :, None] - c_k.permute(0, 2, 1)[..., None, :]
    )  # (B, HQ, Tq, Tk)
    scores = scores + bias.to(compute)
    allowed = k_pos[None, :] <= q_pos[:, None]  # (Tq, Tk)
    if window_size is not None:
        allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window_size)
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    # A query with nothing to attend to (fully masked row) gives 0, not NaN. A NaN or inf in
    # the inputs still comes out as NaN; one in k or v also at the chunk's earlier queries
    # (0 * inf), where the kernel reaches only the queries of its key tile.
    probs = torch.softmax(scores, dim=-1).masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    out = torch.einsum("bhij,bjhd->bihd", probs, v.to(compute))  # (B, Tq, HQ, D)
    return out.to(q.dtype)


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[B, T, H * n_rep, D]``; query head h reads kv head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


def _single_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    scale: float,
    window_size: int | None,
    chunk_size: int,
) -> torch.Tensor:
    T = q.shape[1]
    n_rep = q.shape[2] // k.shape[2]
    k, v = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    c = _gate_cumsum(log_fgate)  # (B, T, HQ) float64
    pos = torch.arange(T, device=q.device)
    outs = []
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        # Keys after the chunk's last query are never attended: slice them off.
        args = (
            q[:, start:end],
            k[:, :end],
            v[:, :end],
            c[:, start:end],
            c[:, :end],
            pos[start:end],
            pos[:end],
            scale,
            window_size,
            None,
        )
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, log_fgate)):
            outs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outs.append(_attend_chunk(*args))
    return torch.cat(outs, dim=1) if outs else q[:, :0].clone()  # T = 0: an empty output


def forgetting_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window_size: int | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Causal forgetting attention in plain PyTorch (any device, any float dtype).

    Args:
        q: ``[B, T, HQ, D]`` queries.
        k: ``[B, T, H, D]`` keys; ``HQ % H == 0`` (grouped-query attention when ``H < HQ``:
            query head ``h`` uses key/value head ``h // (HQ // H)``).
        v: ``[B, T, H, D]`` values.
        log_fgate: ``[B, T, HQ]`` float32 (or float64, with float64 q/k/v), log of the
            forget gate (``<= 0``), e.g. ``F.logsigmoid(gate_logits)``.
        scale: logit scale; default ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` int32/int64 cumulative document lengths for packed documents
            (requires ``B == 1``); attention and the gate cumsum restart at every document.
        window_size: if given, query ``i`` attends only keys ``j`` with ``i - window_size < j
            <= i`` (the ``window_size`` most recent keys, itself included).
        chunk_size: queries processed at once (memory ``~ B * HQ * chunk_size * T``).

    Returns:
        ``[B, T, HQ, D]`` in q's dtype. Internally float32 (float64 for float64 inputs), under
        autocast too, with the gate cumsum in float64. Differentiable in q, k, v and log_fgate.
        A NaN or inf in a key or value makes NaN of every query of its ``chunk_size`` chunk,
        those before it too (their zero weights times it); the Triton kernel spreads it only
        within the key tile it reads (32 to 128 positions).
    """
    check_inputs(q, k, v, log_fgate, cu_seqlens=cu_seqlens, window_size=window_size, debug=True)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size must be a positive int (queries per chunk), got {chunk_size!r}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens is None:
        return _single_sequence(q, k, v, log_fgate, scale, window_size, chunk_size)
    bounds = cu_seqlens.tolist()
    outs = [
        _single_sequence(
            q[:, s:e], k[:, s:e], v[:, s:e], log_fgate[:, s:e], scale, window_size, chunk_size
        )
        for s, e in itertools.pairwise(bounds)
        if e > s
    ]
    return torch.cat(outs, dim=1) if outs else q[:, :0].clone()


def forgetting_attention_decode_reference(
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
    """A few new queries against cached keys/values and a cached gate cumsum.

    The ``Tq`` queries are the last ``Tq`` positions of the ``Tk`` cached keys (the cache
    already holds the new tokens' keys): query ``i`` attends key ``j`` iff
    ``j <= Tk - Tq + i`` (and within the window, and ``key_mask[b, j]``).

    Args:
        q: ``[B, Tq, HQ, D]``.
        k_cache: ``[B, Tk, H, D]``; ``v_cache`` the same shape.
        q_cumsum: ``[B, Tq, HQ]`` float32/float64, running gate cumsum c at the query
            positions.
        k_cumsum: ``[B, Tk, HQ]`` float32/float64, c at the key positions (the same running
            sum; only differences ``c_i - c_j`` matter, so any common offset cancels).
        scale: logit scale; default ``D ** -0.5``.
        window_size: as in :func:`forgetting_attention_reference`.
        key_mask: ``[B, Tk]`` bool, False for keys to ignore (left padding).

    Returns:
        ``[B, Tq, HQ, D]`` in q's dtype (float32 inside, float64 for float64 q, under
        autocast too).
    """
    check_decode_inputs(
        q, k_cache, v_cache, q_cumsum, k_cumsum, key_mask=key_mask, window_size=window_size
    )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    Tq, Tk = q.shape[1], k_cache.shape[1]
    n_rep = q.shape[2] // k_cache.shape[2]
    k, v = _expand_kv(k_cache, n_rep), _expand_kv(v_cache, n_rep)
    q_pos = torch.arange(Tk - Tq, Tk, device=q.device)
    k_pos = torch.arange(Tk, device=q.device)
    return _attend_chunk(
        q, k, v, q_cumsum.double(), k_cumsum.double(), q_pos, k_pos, scale, window_size, key_mask
    )


__all__ = ["forgetting_attention_decode_reference", "forgetting_attention_reference"]
