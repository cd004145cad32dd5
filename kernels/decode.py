"""Decode-time forgetting attention: a few new queries against a long K/V cache.

On CUDA (and under Triton's interpreter) a split-K Triton kernel ("flash decoding"): each
program takes one (batch, kv head), a block of query rows (the query heads sharing that kv head
times the new positions) and one contiguous span of keys, reads each cached key and value once,
and keeps an online softmax in float32; a second kernel merges the spans' partial results. The
gate bias ``c_i - c_j`` and every mask (causal, window, ``key_mask``) are applied on chip, so a
decode step is two launches per layer, however long the cache: the step is memory-bound on
the cache, and the spans keep every SM reading. The gate cumsum of the cache is never
recomputed: the caller passes the running c.

The cumsums may be float64 (as fot's cache keeps them): the kernel takes ``c_i - c_j`` in
float64 and rounds the difference, so a long cache's large ``|c|`` costs no precision.

Elsewhere (CPU without the interpreter, float64 inputs, inputs that need
gradients: a padded training batch attends through this function) the same function runs as
batched PyTorch matmuls (GQA by grouping query heads instead of copying the cache).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import check_decode_inputs, needs_grad, on_input_gpu, sm_count
from .forgetting_attention import MAX_GRID_Y, _interpreting
from .pro_ops import norm_gate

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)

# Private tuning hook (like forgetting_attention._CONFIG_OVERRIDE): "splits" (key spans per
# (batch, kv head, row block)), "block_n" (keys per tile), "warps", "stages".
_CONFIG_OVERRIDE: dict[str, int] = {}


@triton.jit
def _decode_span_kernel(
    Q, K, V, CQ, CK, KMASK, ACC, ML,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_cqb, stride_cqt, stride_cqh,
    stride_ckb, stride_ckt, stride_ckh,
    stride_mb, stride_mt,
    Tq, Tk, H, R, W, span, n_spans, qk_scale,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Partial attention of one row block over one key span.

    Program (b * H + h, span s, row block): rows ``r = rep * Tq + i`` (query head
    ``h * R + rep``, query ``i`` at position ``Tk - Tq + i``), keys ``[s * span, (s + 1) *
    span)``. Writes the unnormalised output ``ACC[bh, s, r, :]`` (float32) and the row's
    running max and sum ``ML[bh, s, r, :] = (m, l)`` (log2 units), ``m = -inf`` and ``l = 0``
    where the span holds no visible key.
    """
    bh = tl.program_id(0)
    s_id = tl.program_id(1)
    b = bh // H
    h = bh % H
    M = R * Tq
    rows = tl.program_id(2) * BM + tl.arange(0, BM)
    row_ok = rows < M
    i = rows % Tq
    hq = h * R + rows // Tq
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + i[:, None] * stride_qt + hq[:, None] * stride_qh
        + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(K.dtype.element_ty)  # fmt: skip
    CK_row = CK + b.to(tl.int64) * stride_ckb + hq * stride_ckh  # (BM,) pointers
    cq = tl.load(CQ + b.to(tl.int64) * stride_cqb + i * stride_cqt + hq * stride_cqh,
                 mask=row_ok, other=0.0)  # fmt: skip
    q_pos = Tk - Tq + i
    # Keys of the span that some row of the block may see: causal (and window) limits.
    lo = s_id * span
    hi = tl.minimum(lo + span, tl.max(tl.where(row_ok, q_pos, -1)) + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, tl.min(tl.where(row_ok, q_pos, Tk)) - W + 1)
    # int64 offsets: a long cache's head or position offsets may pass 2^31 elements
    K_ptr = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    V_ptr = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for n0 in range(lo, hi, BN):
        offs_n = (n0 + tl.arange(0, BN)).to(tl.int64)
        n_ok = offs_n < hi
        kT = tl.load(
            K_ptr + offs_n[None, :] * stride_kt + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        ck = tl.load(
            CK_row[:, None] + offs_n[None, :] * stride_ckt,
            mask=row_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        # the bias in the cumsums' dtype, then float32: float64 cumsums keep the low bits of
        # c_i - c_j that float32 ones of |c| ~ 4e4 (32k steps of log f ~ -1.4) lose
        bias = (cq[:, None] - ck).to(tl.float32)
        s = tl.dot(q, kT, input_precision=DOT_PREC) * qk_scale + bias * _LOG2E
        ok = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & (q_pos[:, None] - offs_n[None, :] < W)
        if HAS_MASK:
            km = tl.load(
                KMASK + b.to(tl.int64) * stride_mb + offs_n * stride_mt, mask=n_ok, other=0
            )
            ok = ok & (km != 0)[None, :]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: exp2 finite
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V_ptr + offs_n[:, None] * stride_vt + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v, input_precision=DOT_PREC)
        m_i = m_new
    base = (bh.to(tl.int64) * n_spans + s_id) * M + rows
    tl.store(ACC + base[:, None] * BD + offs_d[None, :], acc, mask=row_ok[:, None])
    tl.store(ML + base * 2, m_i, mask=row_ok)
    tl.store(ML + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    ACC, ML, Out, G, W, stride_ob, stride_ot, stride_oh, stride_gb, stride_gt, stride_gh,
    Tq, H, R, n_spans, eps,
    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_GATE: tl.constexpr,
):  # fmt: skip
    """``Out[b, i, h * R + rep, :]`` from the spans' partial results of row ``rep * Tq + i``:
    ``sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s`` with ``m = max_s m_s``; 0 for a row
    that sees no key. With ``HAS_NORM`` / ``HAS_GATE`` the row, rounded to Out's dtype, is
    then normalised and gated as ``norm_gate`` does it: ``o * rsqrt(mean_D(o^2) + eps) *
    W[hq] * sigmoid(G[b, i, hq])`` in float32, rounded once more."""
    M = R * Tq
    bh = tl.program_id(0) // M
    row = tl.program_id(0) % M
    b = bh // H
    h = bh % H
    spans = tl.arange(0, BS)
    s_ok = spans < n_spans
    base = (bh.to(tl.int64) * n_spans + spans) * M + row
    m_s = tl.load(ML + base * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(ML + base * 2 + 1, mask=s_ok, other=0.0)
    m = tl.max(m_s, 0)
    w = tl.math.exp2(m_s - tl.where(m == float("-inf"), 0.0, m))
    offs_d = tl.arange(0, BD)
    acc = tl.load(ACC + base[:, None] * BD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    num = tl.sum(w[:, None] * acc, 0)
    den = tl.sum(w * l_s, 0)
    out = (num / tl.where(den == 0.0, 1.0, den)).to(Out.dtype.element_ty)
    i = row % Tq
    hq = h * R + row // Tq
    d_ok = offs_d < D
    if HAS_NORM or HAS_GATE:
        y = tl.where(d_ok, out.to(tl.float32), 0.0)
        if HAS_NORM:
            nw = tl.load(W + hq * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            y = y * tl.rsqrt(tl.sum(y * y, 0) / D + eps) * nw
        if HAS_GATE:
            g_ptr = G + b.to(tl.int64) * stride_gb + i * stride_gt + hq * stride_gh + offs_d
            y = y * tl.sigmoid(tl.load(g_ptr, mask=d_ok, other=0.0).to(tl.float32))
        out = y.to(Out.dtype.element_ty)
    tl.store(Out + b.to(tl.int64) * stride_ob + i * stride_ot + hq * stride_oh + offs_d, out,
             mask=d_ok)  # fmt: skip


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


@triton.jit
def _append_kernel(
    KN, VN, LF, KB, VB, CB, COUT, POS, KP, VP, KS, VS, KL, VL, KW, Q, QW, QO,
    s_knb, s_knh, s_knd, s_vnb, s_vnh, s_vnd, s_lfb, s_lfh,
    s_kbb, s_kbh, s_kbt, s_kbd, s_vbb, s_vbh, s_vbt, s_vbd, s_cbb, s_cbt, s_cbh,
    s_kpb, s_kph, s_kpd, s_vpb, s_vph, s_vpd, s_ksb, s_ksh, s_ksd, s_vsb, s_vsh, s_vsd,
    s_klb, s_klh, s_vlb, s_vlh, s_qb, s_qh, s_qd,
    H, HQ, k_eps, q_eps,
    D: tl.constexpr, DV: tl.constexpr,
    BH: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BQ: tl.constexpr,
    K_SHIFT: tl.constexpr, V_SHIFT: tl.constexpr,
    K_MIX: tl.constexpr, K_NORM: tl.constexpr, V_MIX: tl.constexpr, Q_NORM: tl.constexpr,
):  # fmt: skip
    """One new token of sequence ``b`` (program ``b``) into a fixed-capacity cache at the
    device position ``POS``: ``KB[b, :, pos] = KN[b]`` and ``VB`` likewise (cast to the
    buffers' dtype), ``CB[b, pos] = COUT[b] = float64(LF[b]) + float64(CB[b, pos - 1])``
    (rounded to CB's dtype), and with KV-shift the pre-shift projections into ``KS[b]`` / ``VS[b]``.

    With ``K_MIX`` / ``K_NORM`` (``V_MIX``) the key (value) written is first shifted and
    normalised as ``shift_norm`` does it: ``z = x + sigmoid(KL) (KS - x)`` with ``x = KN``
    (then ``KP`` is ``KN``: the old ``KS`` is read before the new one is written), then
    ``z * rsqrt(mean_D(z^2) + k_eps) * KW``, in float32, rounded to KN's dtype once. With
    ``Q_NORM`` the query ``Q[b]`` is normalised likewise (weight ``QW``) into ``QO[b]``."""
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS).to(tl.int64)
    hs = tl.arange(0, BH)[:, None]
    ds = tl.arange(0, BD)[None, :]
    dv = tl.arange(0, BDV)[None, :]
    ok = (hs < H) & (ds < D)
    okv = (hs < H) & (dv < DV)
    qs = tl.arange(0, BQ)
    qok = qs < HQ
    # Every load is issued before the first store: the program's time is the latency of its
    # loads, so one round trip to memory instead of one per part.
    k = tl.load(KN + b * s_knb + hs * s_knh + ds * s_knd, mask=ok, other=0.0)
    v = tl.load(VN + b * s_vnb + hs * s_vnh + dv * s_vnd, mask=okv, other=0.0)
    if K_MIX:
        k_s = tl.load(KL + b * s_klb + hs * s_klh, mask=hs < H, other=0.0).to(tl.float32)
        k_p = tl.load(KS + b * s_ksb + hs * s_ksh + ds * s_ksd, mask=ok, other=0.0)
    if K_NORM:
        k_w = tl.load(KW + hs * D + ds, mask=ok, other=0.0).to(tl.float32)
    if V_MIX:
        v_s = tl.load(VL + b * s_vlb + hs * s_vlh, mask=hs < H, other=0.0).to(tl.float32)
        v_p = tl.load(VS + b * s_vsb + hs * s_vsh + dv * s_vsd, mask=okv, other=0.0)
    if K_SHIFT and not K_MIX:  # with K_MIX, KP is KN
        kp = tl.load(KP + b * s_kpb + hs * s_kph + ds * s_kpd, mask=ok)
    if V_SHIFT and not V_MIX:
        vp = tl.load(VP + b * s_vpb + hs * s_vph + dv * s_vpd, mask=okv)
    if Q_NORM:
        qh = qs[:, None]
        okq = (qh < HQ) & (ds < D)
        x = tl.load(Q + b * s_qb + qh * s_qh + ds * s_qd, mask=okq, other=0.0).to(tl.float32)
        q_w = tl.load(QW + qh * D + ds, mask=okq, other=0.0).to(tl.float32)
    lf = tl.load(LF + b * s_lfb + qs * s_lfh, mask=qok, other=0.0).to(tl.float64)
    prev = tl.load(CB + b * s_cbb + (pos - 1) * s_cbt + qs * s_cbh, mask=qok, other=0.0)

    if K_MIX or K_NORM:
        z = k.to(tl.float32)
        if K_MIX:
            z = z + tl.sigmoid(k_s) * (k_p.to(tl.float32) - z)
        if K_NORM:
            rstd = tl.rsqrt(tl.sum(z * z, axis=1) / D + k_eps)  # (BH,)
            z = z * rstd[:, None] * k_w
        k_out = z.to(KN.dtype.element_ty)
    else:
        k_out = k
    tl.store(KB + b * s_kbb + hs * s_kbh + pos * s_kbt + ds * s_kbd,
             k_out.to(KB.dtype.element_ty), mask=ok)  # fmt: skip
    if V_MIX:
        z = v.to(tl.float32)
        v_out = (z + tl.sigmoid(v_s) * (v_p.to(tl.float32) - z)).to(VN.dtype.element_ty)
    else:
        v_out = v
    tl.store(VB + b * s_vbb + hs * s_vbh + pos * s_vbt + dv * s_vbd,
             v_out.to(VB.dtype.element_ty), mask=okv)  # fmt: skip
    if K_MIX or V_MIX:
        tl.debug_barrier()  # every thread has read the old KS / VS before any overwrites it
    if K_SHIFT:
        if K_MIX:
            kp = k
        tl.store(KS + b * s_ksb + hs * s_ksh + ds * s_ksd, kp.to(KS.dtype.element_ty), mask=ok)
    if V_SHIFT:
        if V_MIX:
            vp = v
        tl.store(VS + b * s_vsb + hs * s_vsh + dv * s_vsd, vp.to(VS.dtype.element_ty), mask=okv)
    if Q_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + q_eps)  # (BQ,)
        q_out = (x * rstd[:, None] * q_w).to(QO.dtype.element_ty)
        tl.store(QO + (b * HQ + qh) * D + ds, q_out, mask=okq)
    c = (lf + prev.to(tl.float64)).to(CB.dtype.element_ty)
    tl.store(CB + b * s_cbb + pos * s_cbt + qs * s_cbh, c, mask=qok)
    tl.store(COUT + b * HQ + qs, c, mask=qok)


def decode_append_supported(
    k_buf: torch.Tensor, *new: torch.Tensor | None, log_fgate: torch.Tensor
) -> bool:
    """Whether :func:`decode_append` takes a cache with these buffers and new tensors
    (``k, v, k_pre, v_pre``; None for an absent one): on CUDA (or under the interpreter),
    float32 gate inputs (float64 keeps the PyTorch ops), nothing to
    differentiate (it has no backward)."""
    return (
        (k_buf.is_cuda or _interpreting())
        and log_fgate.dtype == torch.float32
        and not needs_grad(*new, log_fgate)
    )


@on_input_gpu
def decode_append(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    c_buf: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    pos: torch.Tensor,
    k_pre: torch.Tensor | None = None,
    k_shift: torch.Tensor | None = None,
    v_pre: torch.Tensor | None = None,
    v_shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write one new token per sequence into a fixed-capacity cache, in one launch.

    The same as ``k_buf.index_copy_(2, pos, k.transpose(1, 2).to(k_buf.dtype))``, likewise
    for ``v``, ``c = (log_fgate.double() + c_buf[:, pos - 1].double()).to(c_buf.dtype)`` written at
    ``c_buf[:, pos]``, and ``k_shift.copy_(k_pre[:, -1])`` / ``v_shift.copy_(v_pre[:, -1])``
    (about ten small launches as PyTorch ops). Bit-equal to them.

    Args:
        k_buf, v_buf: ``[B, H, capacity, D]`` key / value buffers (head-major).
        c_buf: ``[B, capacity, HQ]`` float64 (as fot's cache keeps it) or float32 gate cumsum
            buffer.
        k, v: ``[B, 1, H, D]`` the new token's key and value (any float dtype).
        log_fgate: ``[B, 1, HQ]`` float32 log forget gates of the new token.
        pos: ``[1]`` int64 on the buffers' device, the position to write (``>= 1``: the cumsum
            continues from ``pos - 1``).
        k_pre, k_shift: ``[B, 1, H, D]`` pre-shift key projection and the ``[B, H, D]`` buffer
            that keeps it (KV-shift), or both None; ``v_pre``, ``v_shift`` likewise.

    Returns:
        ``[B, 1, HQ]`` in c_buf's dtype, the new token's cumsum.
    """
    return _launch_append(
        k_buf, v_buf, c_buf, k, v, log_fgate, pos, k_pre, k_shift, v_pre, v_shift
    )[0]


@on_input_gpu
def decode_shift_norm_append(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    c_buf: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    pos: torch.Tensor,
    q: torch.Tensor,
    *,
    k_logits: torch.Tensor | None = None,
    k_shift: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    k_eps: float = 1e-6,
    v_logits: torch.Tensor | None = None,
    v_shift: torch.Tensor | None = None,
    q_weight: torch.Tensor | None = None,
    q_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A static decode step's KV-shift, q/k RMSNorm and cache write, in one launch.

    The math of ``shift_norm`` (``fot.kernels.pro_ops``) of the new key (continuing from
    ``k_shift``), of the new value and of the query, followed by :func:`decode_append` of the
    shifted key and value with ``k`` / ``v`` as the pre-shift projections: four launches in
    one, float32 inside and one rounding per output as there (the norm's sum may be reduced in
    another order: a float32 ulp or two). Each part is optional (a model without KV-shift or
    QK-norm).

    Args:
        k_buf, v_buf, c_buf, log_fgate, pos: as :func:`decode_append`.
        k, v: ``[B, 1, H, D]`` the new token's key and value projections (before shift and
            norm; any float dtype, unit stride not needed).
        q: ``[B, 1, HQ, D]`` the new token's query projection.
        k_logits, k_shift: ``[B, 1, H]`` logits of the key's shift weight and the ``[B, H, D]``
            buffer holding the previous token's pre-shift key, which is read, then overwritten
            with ``k``; both or neither. ``v_logits``, ``v_shift`` likewise.
        k_weight, k_eps: ``[H, D]`` per-head RMSNorm weight of the key (None: no norm) and its
            epsilon; ``q_weight`` ``[HQ, D]``, ``q_eps`` for the query.

    Returns:
        ``([B, 1, HQ]`` cumsum of the new token in c_buf's dtype, ``[B, 1, HQ, D]`` query in q's
        dtype: normalised, contiguous with ``q_weight``, else ``q`` itself``)``.

    Raises:
        ValueError: a shift's logits given without its buffer or the other way round.
    """
    for name, logits, buf in (("k", k_logits, k_shift), ("v", v_logits, v_shift)):
        if (logits is None) != (buf is None):
            raise ValueError(
                f"{name}_logits and {name}_shift go together (the shift mixes in the buffer's "
                f"previous {name}); got only {name}_{'logits' if buf is None else 'shift'}"
            )
    return _launch_append(
        k_buf, v_buf, c_buf, k, v, log_fgate, pos,
        k if k_shift is not None else None, k_shift,
        v if v_shift is not None else None, v_shift,
        k_logits=k_logits, k_weight=k_weight, k_eps=k_eps, v_logits=v_logits,
        q=q, q_weight=q_weight, q_eps=q_eps,
    )  # fmt: skip


def _launch_append(
    k_buf, v_buf, c_buf, k, v, log_fgate, pos, k_pre, k_shift, v_pre, v_shift, *,
    k_logits=None, k_weight=None, k_eps=1e-6, v_logits=None, q=None, q_weight=None, q_eps=1e-6,
):  # fmt: skip
    """``_append_kernel`` over the batch: returns ``(c, q_out)`` (q_out is None without q)."""
    B, _, H, D = k.shape
    HQ, DV = log_fgate.shape[-1], v.shape[-1]
    c = torch.empty(B, 1, HQ, dtype=c_buf.dtype, device=k.device)
    q_out = q
    if q is not None and q_weight is not None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0:
        return c, q_out
    kp = k_pre if k_pre is not None else k
    ks = k_shift if k_shift is not None else k_buf
    vp = v_pre if v_pre is not None else v
    vs = v_shift if v_shift is not None else v_buf
    kp_s = (kp.stride(0), kp.stride(2), kp.stride(3))
    ks_s = ks.stride()[-3:]
    vp_s = (vp.stride(0), vp.stride(2), vp.stride(3))
    vs_s = vs.stride()[-3:]
    kl = k_logits if k_logits is not None else log_fgate
    vl = v_logits if v_logits is not None else log_fgate
    qn = q if q_weight is not None else k
    _append_kernel[(B,)](
        k, v, log_fgate, k_buf, v_buf, c_buf, c, pos, kp, vp, ks, vs, kl, vl,
        k_weight.contiguous() if k_weight is not None else k, qn,
        q_weight.contiguous() if q_weight is not None else k,
        q_out if q_weight is not None else k,
        k.stride(0), k.stride(2), k.stride(3), v.stride(0), v.stride(2), v.stride(3),
        log_fgate.stride(0), log_fgate.stride(2),
        *k_buf.stride(), *v_buf.stride(), *c_buf.stride(),
        *kp_s, *vp_s, *ks_s, *vs_s,
        kl.stride(0), kl.stride(2), vl.stride(0), vl.stride(2),
        qn.stride(0), qn.stride(2), qn.stride(3),
        H, HQ, float(k_eps), float(q_eps), D=D, DV=DV,
        BH=triton.next_power_of_2(H), BD=triton.next_power_of_2(D),
        BDV=triton.next_power_of_2(DV), BQ=triton.next_power_of_2(HQ),
        K_SHIFT=k_shift is not None, V_SHIFT=v_shift is not None,
        K_MIX=k_logits is not None, K_NORM=k_weight is not None, V_MIX=v_logits is not None,
        Q_NORM=q_weight is not None,
        num_warps=4,
    )  # fmt: skip
    return c, q_out


def _triton_ok(q, k_cache, v_cache, q_cumsum, k_cumsum) -> bool:
    """Whether the Triton kernels take these (checked) inputs: CUDA tensors or the
    interpreter, 16/32-bit q and caches, float32 or float64 cumsums, nothing to differentiate
    (a padded training batch goes through the decode function)."""
    if not (q.is_cuda or _interpreting()) or needs_grad(q, k_cache, v_cache, q_cumsum, k_cumsum):
        return False
    small = (torch.float16, torch.bfloat16, torch.float32)
    sums = (torch.float32, torch.float64)
    return all(t.dtype in small for t in (q, k_cache, v_cache)) and (
        q_cumsum.dtype in sums and k_cumsum.dtype in sums
    )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride on its last dim (a copy only when it has another)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _span_launch(programs: int, keys: int, block_d: int, sms: int) -> dict[str, int]:
    """The span kernel's launch for ``programs`` (batch, kv head, row block) triples over
    ``keys`` cached keys on a GPU of ``sms`` SMs: ``splits`` (key spans per triple),
    ``block_n`` (keys per tile), ``warps`` and ``stages``, each from ``_CONFIG_OVERRIDE``
    where it is set there."""
    block_n = _CONFIG_OVERRIDE.get("block_n", 64 if block_d <= 128 else 32)
    # Split the keys until (batch, kv heads, row blocks, spans) make ~4 programs per SM, not
    # more: one span too many took 1.3x the time at B=8, H=24 on an H100. (Tuned by timing:
    # by registers only 2 of these programs are resident on an SM at once, 241 a thread for
    # sm_90 under Triton 3.7.)
    tiles = triton.cdiv(keys, block_n)
    splits, warps, stages = max(1, min(tiles, (4 * sms) // programs)), 4, 3
    if block_d <= 64 and triton.cdiv(tiles, splits) > 32:
        # Long spans (many sequences): more, smaller programs (2 warps, 2 stages; 6 per SM in
        # all, 4 resident at once). At 16k keys, H=24, D=64 on an H100 (`benchmarks/fused_ops.py
        # --decode-attention`) that was the fastest setting at B=4 and 272 against 286 us a
        # layer at B=8; at B=1 and 2 (12 and 24 tiles a span) the launch above was the
        # fastest. This launch uses 40 bytes of stack under Triton 3.7 (56 under 3.6, where it
        # was timed: those timings include it).
        splits, warps, stages = max(1, min(tiles, (6 * sms) // programs)), 2, 2
    return {
        "splits": _CONFIG_OVERRIDE.get("splits", splits),
        "block_n": block_n,
        "warps": _CONFIG_OVERRIDE.get("warps", warps),
        "stages": _CONFIG_OVERRIDE.get("stages", stages),
    }


@on_input_gpu
def _decode_triton(
    q, k_cache, v_cache, q_cumsum, k_cumsum, scale, window_size, key_mask, gate, norm_weight,
    norm_eps,
):  # fmt: skip
    """:func:`forgetting_attention_decode` by the split-K kernels (checked inputs)."""
    B, Tq, HQ, D = q.shape
    Tk, H = k_cache.shape[1], k_cache.shape[2]
    R = HQ // H
    M = R * Tq
    out = torch.empty(B, Tq, HQ, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if k_cache.dtype != v_cache.dtype or (
        _interpreting() and torch.bfloat16 in (q.dtype, k_cache.dtype)
    ):
        # One dtype for the two matmuls' operands. The interpreter's tl.dot multiplies raw
        # bf16 bit patterns (DESIGN.md §4): float32 there.
        k_cache, v_cache = k_cache.float(), v_cache.float()
    q, k, v = _unit_last(q), _unit_last(k_cache), _unit_last(v_cache)
    BD = max(16, triton.next_power_of_2(D))
    BM = min(64, max(16, triton.next_power_of_2(M)))
    n_mb = triton.cdiv(M, BM)
    sms = sm_count(q.device.index) if q.is_cuda else 8  # the interpreter: a small GPU
    launch = _span_launch(B * H * n_mb, Tk, BD, sms)
    BN, n_spans = launch["block_n"], launch["splits"]
    span = triton.cdiv(triton.cdiv(Tk, n_spans), BN) * BN
    n_spans = triton.cdiv(Tk, span)
    acc = torch.empty(B * H * n_spans * M * BD, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * H * n_spans * M * 2, dtype=torch.float32, device=q.device)
    mask = key_mask.view(torch.uint8) if key_mask is not None else k  # a dummy when unused
    stride_m = mask.stride() if key_mask is not None else (0, 0)
    _decode_span_kernel[(B * H, n_spans, n_mb)](
        q, k, v, q_cumsum, k_cumsum, mask, acc, ml,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *q_cumsum.stride(), *k_cumsum.stride(), *stride_m,
        Tq, Tk, H, R, window_size or 0, span, n_spans, scale * LOG2E,
        D=D, BD=BD, BM=BM, BN=BN, HAS_MASK=key_mask is not None,
        HAS_WINDOW=window_size is not None,
        DOT_PREC="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=launch["warps"], num_stages=launch["stages"],
    )  # fmt: skip
    g = gate if gate is not None else out
    _decode_merge_kernel[(B * H * M,)](
        acc, ml, out, g, norm_weight.contiguous() if norm_weight is not None else out,
        out.stride(0), out.stride(1), out.stride(2), g.stride(0), g.stride(1), g.stride(2),
        Tq, H, R, n_spans, float(norm_eps),
        D=D, BD=BD, BS=max(2, triton.next_power_of_2(n_spans)),
        HAS_NORM=norm_weight is not None, HAS_GATE=gate is not None,
    )  # fmt: skip
    return out


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
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Few queries vs cached keys/values; same contract as the decode reference.

    With ``gate`` and/or ``norm_weight`` the result then goes through the output norm and
    gate, ``norm_gate(o, gate, norm_weight, eps=norm_eps)`` (``fot.kernels.norm_gate``): on
    the Triton path inside the kernel that merges the key spans (no launch of its own; the
    math of the two calls, the norm's sum perhaps reduced in another order), elsewhere as that
    second call.

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
        gate: ``[B, Tq, HQ, D]`` logits of the output gate (any float dtype), or None.
        norm_weight: ``[HQ, D]`` per-head RMSNorm weight of the output, or None.
        norm_eps: the norm's epsilon.

    Returns:
        ``[B, Tq, HQ, D]`` in q's dtype (float32 softmax inside; float64 for float64 input;
        under autocast too). A query with no visible key gets zeros. With a 16-bit cache, q is
        rounded to the cache dtype for ``q kᵀ`` and the probabilities for ``P V``, as in
        FlashAttention; the scores, the bias and the softmax stay float32. A NaN in ``q``, or
        in a key, value or cumsum the query sees, gives NaN. Where the Triton kernels run
        (without autograd), a NaN/inf value the query does not see reaches it only inside
        the key tiles the kernel reads (never before a window's start), and a query whose
        every visible score is ``-inf`` gets zeros; the PyTorch path and the reference give
        NaN for both.
    """
    check_decode_inputs(
        q, k_cache, v_cache, q_cumsum, k_cumsum, key_mask=key_mask, window_size=window_size
    )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    args = (q, k_cache, v_cache, q_cumsum, k_cumsum, float(scale), window_size, key_mask)
    epilogue = gate is not None or norm_weight is not None
    if epilogue:
        _check_epilogue(q, gate, norm_weight, norm_eps)
    M = (q.shape[2] // k_cache.shape[2]) * q.shape[1]
    if (
        _triton_ok(q, k_cache, v_cache, q_cumsum, k_cumsum)
        and triton.cdiv(M, 64) <= MAX_GRID_Y
        and not needs_grad(gate, norm_weight)
    ):
        return _decode_triton(*args, None if gate is None else _unit_last(gate), norm_weight,
                              norm_eps)  # fmt: skip
    if torch.is_autocast_enabled(q.device.type):
        # autocast would run the float32 matmuls in 16 bits (scores rounded to bf16: 1e-2
        # off); without it the ops are those outside autocast (a 16-bit cache is read as is)
        with torch.autocast(q.device.type, enabled=False):
            out = _decode_pytorch(*args)
    else:
        out = _decode_pytorch(*args)
    if not epilogue:
        return out
    if out.dtype != torch.float64:
        return norm_gate(out, gate, norm_weight, eps=norm_eps)
    if norm_weight is not None:  # norm_gate takes 16/32-bit floats: float64 stays float64
        out = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + norm_eps) * norm_weight
    return out * torch.sigmoid(gate.double()) if gate is not None else out


def _check_epilogue(
    q: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> None:
    """The output gate and norm of :func:`forgetting_attention_decode`: shapes and devices."""
    B, Tq, HQ, D = q.shape
    for name, t, shape in (("gate", gate, (B, Tq, HQ, D)), ("norm_weight", weight, (HQ, D))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point tensor {list(shape)}, got {got}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (from q), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it")
    if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):
        raise ValueError(f"norm_eps must be a positive finite number, got {eps!r}")


def _decode_pytorch(q, k_cache, v_cache, q_cumsum, k_cumsum, scale, window_size, key_mask):
    """:func:`forgetting_attention_decode` as PyTorch ops (checked inputs, autocast off)."""
    B, Tq, HQ, D = q.shape
    Tk, H = k_cache.shape[1], k_cache.shape[2]
    R = HQ // H
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


__all__ = [
    "decode_append",
    "decode_append_supported",
    "decode_shift_norm_append",
    "forgetting_attention_decode",
]
