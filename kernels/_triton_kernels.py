"""Triton jit kernels for causal forgetting attention (forward and backward).

Conventions shared by every kernel here:

* q/k/v/o/do are ``[B, T, heads, D]`` with a unit stride on D; strides are passed in.
* ``C`` is the gate cumsum in log2 units, ``c * log2(e)``, as a float32 pair ``[B, HQ, 2, T]``
  (hi = float32 rounding of the float64 sum, lo = the remainder). Each program anchors it at
  one position ``a`` of its own tile, ``(hi - a_hi) + (lo - a_lo)`` (the hi difference is
  exact, Sterbenz), so the bias ``c_i - c_j`` does not degrade with sequence length or |c|
  (DESIGN.md §4). Its error is ~6e-8 x (|c_i - a| + |c_j - a|). Anchors: the first query of
  a query tile (forward, dQ) and the last key of a key tile (dK/dV); then for every pair
  outside the diagonal tile both terms are <= |c_i - c_j|, i.e. float32 relative accuracy of
  the bias. Inside the diagonal tile the error is bounded by ~6e-8 x the fall of c within
  that one tile (e.g. 1e-4 nats only if the gates drop by ~2000 nats inside 128 positions).
  Where both sides of ``c_i - c_j`` are built in one kernel they may drop ``a_lo`` (the "key
  form" ``(hi - a_hi) + lo``): it cancels, one op per value fewer. The dQ kernel stores
  ``lo - LSE`` per query so that the dK/dV kernel forms ``c_i - LSE_i`` in two ops.
* Scores live in log2 units: ``s = qk * scale * log2(e) + (c_i - c_j) * log2(e)`` and
  ``exp2`` replaces ``exp``. ``LSE`` is stored in log2 units.
* Query row ``i`` sees key ``j`` iff ``lb_i <= j <= i`` with ``lb_i = max(doc_start_i,
  i - W + 1)`` (doc_start only with packed documents, the window term only with a window).
* One loop per program over its key (or query) tiles, with the causal/document/window mask
  applied to every tile (a few integer ops per score; an isolated H200 forward with it ran at
  351 TFLOP/s, 385 without any bias or mask). Loads are unmasked when ``EVEN`` (T a multiple
  of every tile size).
* Exact pruning (c is non-increasing, so the bias only falls with distance): a key tile whose
  scores are all ``< row max - PRUNE_LOG2`` (2^-160: exp2 underflows to exactly 0 in float32)
  contributes nothing and is skipped. The bound is ``|scale|*|q_i|*max_j|k_j| + c_i - c_j``
  against a lower bound of the row max: in the forward the running max after the diagonal
  block, which it visits first (at least the diagonal score ``s_ii``); in the backward the
  LSE, plus how far float32 may round scores of that size (``_rounding_slack``). The first
  key tile to visit is found by a binary search over c.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# log2(e) as two float32 constants (hi + lo, exact to ~1e-15) for float64 math inside kernels:
# a plain float constant would enter a kernel rounded to float32.
_LOG2E_HI_F = struct.unpack("f", struct.pack("f", LOG2E))[0]
_LOG2E_HI = tl.constexpr(_LOG2E_HI_F)
_LOG2E_LO = tl.constexpr(struct.unpack("f", struct.pack("f", LOG2E - _LOG2E_HI_F))[0])


@triton.jit
def _row_lower_bound(offs_m, T, DOCSTART, W, HAS_DOC: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Smallest key each query row may see (int32 vector)."""
    lb = tl.zeros_like(offs_m)
    if HAS_DOC:
        lb = tl.load(DOCSTART + offs_m, mask=offs_m < T, other=0)
    if HAS_WINDOW:
        lb = tl.maximum(lb, offs_m - W + 1)
    return lb


@triton.jit
def _c_rel(C_row, offs, T, a_hi, a_lo, MASKED: tl.constexpr):
    """c (log2 units) at ``offs`` relative to the anchor, in float32.

    With ``a_lo = 0`` (the "key form", ``(hi - a_hi) + lo``) the value is off by the anchor's
    lo part, which cancels in ``c_i - c_j`` when both sides take that form: one op per value
    fewer, the same accuracy."""
    if MASKED:
        hi = tl.load(C_row + offs, mask=offs < T, other=0.0)
        lo = tl.load(C_row + T + offs, mask=offs < T, other=0.0)
    else:
        hi = tl.load(C_row + offs)
        lo = tl.load(C_row + T + offs)
    return (hi - a_hi) + (lo - a_lo)


@triton.jit
def _rounding_slack(reach, c, m, D: tl.constexpr):
    """How far float32 may round a score ``q.k * scale + c_i - c_j`` and its difference to
    the row's max ``m`` (or LSE) above their exact values, in log2 units, per row. The dot
    product's ``D`` terms, the scaling, the bias and the max round by at most ``(D + 3)``
    times 2^-24 of magnitudes up to ``reach = |scale| |q| max|k|``, ``|c|`` and ``|m|``; the
    slack takes ``(2D + 16)`` times 2^-23, four times that and more, as tensor cores truncate
    in their accumulation. Exact pruning adds it to its bound: at scores ~1e9 one ulp is 64
    units, more than the margin in ``prune_log2``; at scores ~100 the slack is ~3e-3 units."""
    return (reach + tl.abs(c) + tl.abs(m)) * ((2 * D + 16) * 1.1920928955078125e-07)


@triton.jit
def _first_needed_key(C_row, g, a_hi, a_lo, t_lo, t_hi, T, BN: tl.constexpr):
    """First key tile in [t_lo, t_hi] whose last key has c - anchor <= g (c non-increasing).

    Tiles before it have every key's bias below the pruning bound. Returns t_hi at most, also
    when ``g`` is NaN or -inf (a NaN or inf in q or k): the diagonal tile is always computed,
    so such rows come out NaN as without pruning, not zero.
    """
    last = tl.minimum(t_lo * BN + BN, T) - 1
    c_last = (tl.load(C_row + last) - a_hi) + (tl.load(C_row + T + last) - a_lo)
    lo = t_lo
    hi = t_hi
    if c_last > g:
        # Tile t_lo is prunable; binary search the first tile that is not (t_hi never is).
        lo = t_lo + 1
        while lo < hi:
            mid = (lo + hi) // 2
            pos = tl.minimum(mid * BN + BN, T) - 1
            c_mid = (tl.load(C_row + pos) - a_hi) + (tl.load(C_row + T + pos) - a_lo)
            if c_mid > g:
                lo = mid + 1
            else:
                hi = mid
    return tl.minimum(lo, t_hi)


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, cq, lb, offs_m, offs_d, start_n, K_ptr, V_ptr, stride_kt, stride_vt,
    C_row, T, a_hi, a_lo, qk_scale,
    BN: tl.constexpr, MASK: tl.constexpr, EVEN: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """One key tile of the forward's online softmax. ``MASK``: apply the causal (and, unless
    ``EVEN``, the length) mask; without it only the document/window bound is applied."""
    start_n = tl.multiple_of(start_n, BN)
    offs_n = start_n + tl.arange(0, BN)
    if EVEN or not MASK:
        kT = tl.load(K_ptr + offs_n[None, :] * stride_kt + offs_d[:, None])
        v = tl.load(V_ptr + offs_n[:, None] * stride_vt + offs_d[None, :])
        ck = _c_rel(C_row, offs_n, T, a_hi, a_lo, False)
    else:
        kT = tl.load(
            K_ptr + offs_n[None, :] * stride_kt + offs_d[:, None],
            mask=offs_n[None, :] < T,
            other=0.0,
        )
        v = tl.load(
            V_ptr + offs_n[:, None] * stride_vt + offs_d[None, :],
            mask=offs_n[:, None] < T,
            other=0.0,
        )
        ck = _c_rel(C_row, offs_n, T, a_hi, a_lo, True)
    s = tl.dot(q, kT, input_precision=DOT_PREC) * qk_scale + (cq[:, None] - ck[None, :])
    if MASK:
        ok = offs_n[None, :] <= offs_m[:, None]
        if not EVEN:
            ok = ok & (offs_n[None, :] < T)
        if HAS_DOC or HAS_WINDOW:
            ok = ok & (offs_n[None, :] >= lb[:, None])
        s = tl.where(ok, s, float("-inf"))
    elif HAS_DOC or HAS_WINDOW:
        s = tl.where(offs_n[None, :] >= lb[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if HAS_DOC or HAS_WINDOW:
        # A row may have no visible key in this tile (and none before): keep exp2 finite.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    C,
    DOCSTART,
    KMAX,
    RISES,
    Out,
    LSE,
    STATS,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ob,
    stride_ot,
    stride_oh,
    T,
    HQ,
    H,
    N_REP,
    qk_scale,
    W,
    prune_log2,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRUNE: tl.constexpr,
    STATS_ON: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    n_m = tl.cdiv(T, BM)
    pid_m = n_m - 1 - tl.program_id(0)  # heaviest (last) tiles first
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // N_REP
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < T
    m_last = tl.minimum(m0 + BM, T) - 1

    Q_ptr = Q + b.to(tl.int64) * stride_qb + h * stride_qh
    K_ptr = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    V_ptr = V + b.to(tl.int64) * stride_vb + hk * stride_vh
    C_row = C + bh.to(tl.int64) * 2 * T

    q = tl.load(
        Q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    a_hi = tl.load(C_row + m0)
    a_lo = tl.load(C_row + T + m0)
    cq = _c_rel(C_row, offs_m, T, a_hi, a_lo, True)
    lb = _row_lower_bound(offs_m, T, DOCSTART, W, HAS_DOC, HAS_WINDOW)
    lb_first = tl.min(tl.where(row_ok, lb, T))

    t_lo = lb_first // BN
    t_hi = m_last // BN
    # The tiles from m0 on (the diagonal block, causally masked) come first, then the
    # unmasked tiles before m0 (BM is a multiple of BN, so those lie wholly below the diagonal
    # and before T). Every row sees its own key in the diagonal block, so the running max m_i
    # after it is a lower bound of the row's final max (at least the diagonal score s_ii).
    t_diag = tl.maximum(t_lo, m0 // BN)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for start_n in range(t_diag * BN, (t_hi + 1) * BN, BN):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, cq, lb, offs_m, offs_d, start_n, K_ptr, V_ptr, stride_kt,
            stride_vt, C_row, T, a_hi, a_lo, qk_scale,
            BN, True, EVEN, HAS_DOC, HAS_WINDOW, DOT_PREC,
        )  # fmt: skip
    if PRUNE:
        # A key tile whose every score is below m_i - prune_log2 adds exactly nothing after
        # the diagonal block: exp2 underflows to 0 and m_i, hence the rescale factor 1, stays.
        qf = q.to(tl.float32)
        q_norm = tl.sqrt(tl.sum(qf * qf, 1))
        kmax = tl.load(KMAX + b * H + hk)
        # |scale|: with a negative scale, q.k * scale is still at most |q| |k| |scale|
        reach = q_norm * kmax * tl.abs(qk_scale)
        bound = reach + cq - m_i  # log2 units, rel. to the anchor
        bound += _rounding_slack(reach, cq, m_i, D)
        g = tl.max(tl.where(row_ok, bound, float("-inf"))) + prune_log2
        # a NaN/inf key or value of the head (kmax = inf): nothing pruned, also for rows whose
        # bound is 0 * inf = NaN (a zero query), which the max above skips; nor where a gate
        # above 1 lets c rise (the bound takes c to never rise)
        off = (kmax == float("inf")) | (tl.load(RISES + bh) != 0)
        g = tl.where(off, float("inf"), g)
        t_first = _first_needed_key(C_row, g, a_hi, a_lo, t_lo, t_diag, T, BN)
    else:
        t_first = t_lo
    if STATS_ON:
        n_prog = tl.num_programs(0)
        tl.store(STATS + (bh * n_prog + pid_m) * 2, t_hi - t_lo + 1)
        tl.store(STATS + (bh * n_prog + pid_m) * 2 + 1, t_first - t_lo)
    for start_n in range(t_first * BN, t_diag * BN, BN):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, cq, lb, offs_m, offs_d, start_n, K_ptr, V_ptr, stride_kt,
            stride_vt, C_row, T, a_hi, a_lo, qk_scale,
            BN, False, EVEN, HAS_DOC, HAS_WINDOW, DOT_PREC,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    # LSE in log2 units, absolute in c (the anchor cancels in c_i - c_j).
    lse = m_i + tl.math.log2(l_safe)
    O_ptr = Out + b.to(tl.int64) * stride_ob + h * stride_oh
    tl.store(
        O_ptr + offs_m[:, None] * stride_ot + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, lse, mask=row_ok)


@triton.jit
def _dq_tile(
    dq, drow, q, do, delta, cq_lse, lb, offs_m, offs_d, start_n, K_ptr, V_ptr, stride_kt,
    stride_vt, C_row, T, a_hi, qk_scale,
    BN: tl.constexpr, MASK: tl.constexpr, EVEN: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """One key tile of the dQ kernel (``MASK`` as in :func:`_fwd_tile`). ``cq_lse`` is the
    queries' ``c - LSE`` (folded once per program: one op per score fewer), c in the key form
    of :func:`_c_rel` on both sides."""
    start_n = tl.multiple_of(start_n, BN)
    offs_n = start_n + tl.arange(0, BN)
    if EVEN or not MASK:
        kT = tl.load(K_ptr + offs_n[None, :] * stride_kt + offs_d[:, None])
        vT = tl.load(V_ptr + offs_n[None, :] * stride_vt + offs_d[:, None])
        ck = _c_rel(C_row, offs_n, T, a_hi, 0.0, False)
    else:
        kT = tl.load(
            K_ptr + offs_n[None, :] * stride_kt + offs_d[:, None],
            mask=offs_n[None, :] < T,
            other=0.0,
        )
        vT = tl.load(
            V_ptr + offs_n[None, :] * stride_vt + offs_d[:, None],
            mask=offs_n[None, :] < T,
            other=0.0,
        )
        ck = _c_rel(C_row, offs_n, T, a_hi, 0.0, True)
    # s - LSE (log2 units) of every score of the tile.
    s = tl.fma(tl.dot(q, kT, input_precision=DOT_PREC), qk_scale, cq_lse[:, None] - ck[None, :])
    # Mask before exp2: masked-out entries (j > i) can have a huge positive bias.
    if MASK:
        ok = offs_n[None, :] <= offs_m[:, None]
        if not EVEN:
            ok = ok & (offs_n[None, :] < T)
        if HAS_DOC or HAS_WINDOW:
            ok = ok & (offs_n[None, :] >= lb[:, None])
        p = tl.math.exp2(tl.where(ok, s, float("-inf")))
    elif HAS_DOC or HAS_WINDOW:
        p = tl.math.exp2(tl.where(offs_n[None, :] >= lb[:, None], s, float("-inf")))
    else:
        p = tl.math.exp2(s)
    dp = tl.dot(do, vT, input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    drow += tl.sum(ds, 1)
    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=DOT_PREC)
    return dq, drow


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    C,
    DOCSTART,
    DO,
    Out,
    LSE,
    DELTA,
    LOLSE,
    DQ,
    DROW,
    KMAX,
    RISES,
    KFIRST,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_dob,
    stride_dot,
    stride_doh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_dqb,
    stride_dqt,
    stride_dqh,
    T,
    HQ,
    H,
    N_REP,
    qk_scale,
    scale,
    W,
    prune_log2,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRUNE: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    n_m = tl.cdiv(T, BM)
    pid_m = n_m - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // N_REP
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < T
    m_last = tl.minimum(m0 + BM, T) - 1

    Q_ptr = Q + b.to(tl.int64) * stride_qb + h * stride_qh
    DO_ptr = DO + b.to(tl.int64) * stride_dob + h * stride_doh
    K_ptr = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    V_ptr = V + b.to(tl.int64) * stride_vb + hk * stride_vh
    C_row = C + bh.to(tl.int64) * 2 * T

    q = tl.load(
        Q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    do = tl.load(
        DO_ptr + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    # Rows past T get lse=+inf, so their p is 0 and nothing non-finite appears.
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=float("inf"))
    # delta_i = sum_d O_id dO_id (O kept in float32 by the forward); stored for dK/dV.
    O_ptr = Out + b.to(tl.int64) * stride_ob + h * stride_oh
    o = tl.load(
        O_ptr + offs_m[:, None] * stride_ot + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, delta, mask=row_ok)
    # For dK/dV: lo - LSE, so that it forms c_i - LSE_i with two ops per query (see there).
    lo = tl.load(C_row + T + offs_m, mask=row_ok, other=0.0)
    tl.store(LOLSE + bh.to(tl.int64) * T + offs_m, lo - lse, mask=row_ok)
    a_hi = tl.load(C_row + m0)
    a_lo = tl.load(C_row + T + m0)
    cq = _c_rel(C_row, offs_m, T, a_hi, a_lo, True)
    # c - LSE in the key form of _c_rel for the tiles; -inf on rows past T.
    cq_lse = _c_rel(C_row, offs_m, T, a_hi, 0.0, True) - lse
    lb = _row_lower_bound(offs_m, T, DOCSTART, W, HAS_DOC, HAS_WINDOW)
    lb_first = tl.min(tl.where(row_ok, lb, T))

    t_lo = lb_first // BN
    t_hi = m_last // BN
    if PRUNE:
        # p = exp2(s - lse): with the final lse the bound is tighter than in the forward.
        qf = q.to(tl.float32)
        q_norm = tl.sqrt(tl.sum(qf * qf, 1))
        kmax = tl.load(KMAX + b * H + hk)
        reach = q_norm * kmax * tl.abs(qk_scale)
        bound = reach + cq - lse + _rounding_slack(reach, cq, lse, D)
        g = tl.max(tl.where(row_ok, bound, float("-inf"))) + prune_log2
        off = (kmax == float("inf")) | (tl.load(RISES + bh) != 0)  # as in the forward
        # A NaN or inf in a row's q (hence O) or dO: delta is not finite, and without pruning
        # dS = p (dp - delta) is NaN for every key the row meets, p = 0 too. Its bound (NaN)
        # is skipped by the max above: nothing pruned, so that the NaN reaches the same dK/dV.
        off = off | (tl.max(tl.where(tl.abs(delta) < float("inf"), 0, 1)) != 0)
        g = tl.where(off, float("inf"), g)
        t_first = _first_needed_key(C_row, g, a_hi, a_lo, t_lo, t_hi, T, BN)
        # The dK/dV kernel reads where each query tile starts.
        tl.store(KFIRST + bh * n_m + pid_m, t_first * BN)
    else:
        t_first = t_lo

    dq = tl.zeros([BM, D], dtype=tl.float32)
    drow = tl.zeros([BM], dtype=tl.float32)
    # As in the forward: key tiles before m0 need no causal or length mask.
    for start_n in range(t_first * BN, m0, BN):
        dq, drow = _dq_tile(
            dq, drow, q, do, delta, cq_lse, lb, offs_m, offs_d, start_n, K_ptr, V_ptr,
            stride_kt, stride_vt, C_row, T, a_hi, qk_scale,
            BN, False, EVEN, HAS_DOC, HAS_WINDOW, DOT_PREC,
        )  # fmt: skip
    for start_n in range(tl.maximum(t_first * BN, m0), (t_hi + 1) * BN, BN):
        dq, drow = _dq_tile(
            dq, drow, q, do, delta, cq_lse, lb, offs_m, offs_d, start_n, K_ptr, V_ptr,
            stride_kt, stride_vt, C_row, T, a_hi, qk_scale,
            BN, True, EVEN, HAS_DOC, HAS_WINDOW, DOT_PREC,
        )  # fmt: skip
    dq = dq * scale
    tl.store(DROW + bh.to(tl.int64) * T + offs_m, drow, mask=row_ok)
    DQ_ptr = DQ + b.to(tl.int64) * stride_dqb + h * stride_dqh
    tl.store(
        DQ_ptr + offs_m[:, None] * stride_dqt + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def _dkdv_tile(
    dk, dv, dcol, k, v, ck, offs_n, offs_d, start_m, Q_ptr, DO_ptr, LSE_row, LOLSE_row,
    DELTA_row, DOCSTART, stride_qt, stride_dot, C_row, T, W, a_hi, qk_scale,
    BM: tl.constexpr, MASK: tl.constexpr, EVEN: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """One query tile of the dK/dV kernel. ``MASK``: causal and (unless ``EVEN``) length masks
    on; without it the tile must lie above the diagonal and before T. ``ck``: the keys' c in
    the key form of :func:`_c_rel`."""
    start_m = tl.multiple_of(start_m, BM)
    offs_m = start_m + tl.arange(0, BM)
    if EVEN or not MASK:
        qT = tl.load(Q_ptr + offs_m[None, :] * stride_qt + offs_d[:, None])
        do = tl.load(DO_ptr + offs_m[:, None] * stride_dot + offs_d[None, :])
        delta = tl.load(DELTA_row + offs_m)
    else:
        row_ok = offs_m < T
        qT = tl.load(
            Q_ptr + offs_m[None, :] * stride_qt + offs_d[:, None],
            mask=row_ok[None, :],
            other=0.0,
        )
        do = tl.load(
            DO_ptr + offs_m[:, None] * stride_dot + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        delta = tl.load(DELTA_row + offs_m, mask=row_ok, other=0.0)
    # s - LSE (log2 units), transposed.
    if MASK:
        # Diagonal tiles: c_i relative to the key anchor may be large (c falls inside the tile),
        # so it meets c_j first, where the two cancel exactly.
        cq = _c_rel(C_row, offs_m, T, a_hi, 0.0, not EVEN)
        if EVEN:
            lse = tl.load(LSE_row + offs_m)
        else:
            lse = tl.load(LSE_row + offs_m, mask=offs_m < T, other=float("inf"))
        sT = tl.dot(k, qT, input_precision=DOT_PREC) * qk_scale + (cq[None, :] - ck[:, None])
        sT = sT - lse[None, :]
        ok = offs_n[:, None] <= offs_m[None, :]
        if not EVEN:
            ok = ok & (offs_m[None, :] < T)
        if HAS_DOC or HAS_WINDOW:
            lb = _row_lower_bound(offs_m, T, DOCSTART, W, HAS_DOC, HAS_WINDOW)
            ok = ok & (offs_n[:, None] >= lb[None, :])
        pT = tl.math.exp2(tl.where(ok, sT, float("-inf")))
    else:
        # Queries after the tile: |c_i - anchor| <= |c_i - c_j|, so c - LSE can be folded per
        # query first without losing the bias's relative accuracy: (hi - a_hi) + (lo - LSE),
        # the second term stored by the dQ kernel (two ops per query, one per score).
        cq_lse = (tl.load(C_row + offs_m) - a_hi) + tl.load(LOLSE_row + offs_m)
        sT = tl.fma(
            tl.dot(k, qT, input_precision=DOT_PREC), qk_scale, cq_lse[None, :] - ck[:, None]
        )
        if HAS_DOC or HAS_WINDOW:
            lb = _row_lower_bound(offs_m, T, DOCSTART, W, HAS_DOC, HAS_WINDOW)
            sT = tl.where(offs_n[:, None] >= lb[None, :], sT, float("-inf"))
        pT = tl.math.exp2(sT)
    dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PREC)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    dsT = pT * (dpT - delta[None, :])
    dcol += tl.sum(dsT, 1)
    dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=DOT_PREC)
    return dk, dv, dcol


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    C,
    DOCSTART,
    DOCEND,
    DO,
    LSE,
    DELTA,
    LOLSE,
    DK,
    DV,
    DCOL,
    KF,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_dob,
    stride_dot,
    stride_doh,
    stride_dkb,
    stride_dkt,
    stride_dkh,
    stride_dvb,
    stride_dvt,
    stride_dvh,
    T,
    HQ,
    H,
    N_REP,
    qk_scale,
    scale,
    W,
    n_dq,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    DQ_BM: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRUNE: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)  # first key tiles see the most queries: schedule them first
    bhk = tl.program_id(1)
    b = bhk // H
    hk = bhk % H
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    col_ok = offs_n < T
    n_last = tl.minimum(n0 + BN, T) - 1

    K_ptr = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    V_ptr = V + b.to(tl.int64) * stride_vb + hk * stride_vh
    k = tl.load(
        K_ptr + offs_n[:, None] * stride_kt + offs_d[None, :], mask=col_ok[:, None], other=0.0
    )
    v = tl.load(
        V_ptr + offs_n[:, None] * stride_vt + offs_d[None, :], mask=col_ok[:, None], other=0.0
    )

    # Rows that may see some key of this tile: [n0, r_hi).
    r_hi = T
    if HAS_DOC:
        r_hi = tl.load(DOCEND + n_last)
    if HAS_WINDOW:
        r_hi = tl.minimum(r_hi, n_last + W)
    start = (n0 // BM) * BM
    end = tl.cdiv(r_hi, BM) * BM

    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    for g in range(0, N_REP):
        h = hk * N_REP + g
        bh = b * HQ + h
        Q_ptr = Q + b.to(tl.int64) * stride_qb + h * stride_qh
        DO_ptr = DO + b.to(tl.int64) * stride_dob + h * stride_doh
        C_row = C + bh.to(tl.int64) * 2 * T
        LSE_row = LSE + bh.to(tl.int64) * T
        LOLSE_row = LOLSE + bh.to(tl.int64) * T
        DELTA_row = DELTA + bh.to(tl.int64) * T
        # Anchor at the tile's last key: every query after the tile then sees
        # |c - anchor| <= |c_i - c_j| on both sides, so the bias keeps float32 relative accuracy.
        a_hi = tl.load(C_row + n_last)
        ck = _c_rel(C_row, offs_n, T, a_hi, 0.0, True)
        dcol = tl.zeros([BN], dtype=tl.float32)
        end_g = end
        if PRUNE:
            # KF[t] = first key any query of dq tile t (or of a later one) needs: a
            # non-decreasing row, so the query tiles that need this key tile are a prefix of
            # [start, end). Tile 0 (holding the diagonal) always does.
            KF_row = KF + bh * n_dq
            lo = 1
            hi = (end - start) // BM
            if tl.load(KF_row + (start + (hi - 1) * BM) // DQ_BM) <= n_last:
                lo = hi  # the last query tile needs this key tile: so do all (no search)
            while lo < hi:
                mid = (lo + hi) // 2
                if tl.load(KF_row + (start + mid * BM) // DQ_BM) <= n_last:
                    lo = mid + 1
                else:
                    hi = mid
            end_g = start + lo * BM
        # Query tiles from diag_end on lie wholly above the diagonal; before T (``full_end``)
        # they need no causal or length mask. The diagonal tiles and a partial last tile do.
        diag_end = tl.minimum(end_g, tl.cdiv(n0 + BN, BM) * BM)
        full_end = end_g
        if not EVEN:
            full_end = tl.minimum(end_g, (T // BM) * BM)
        for start_m in range(start, diag_end, BM):
            dk, dv, dcol = _dkdv_tile(
                dk, dv, dcol, k, v, ck, offs_n, offs_d, start_m, Q_ptr, DO_ptr, LSE_row,
                LOLSE_row, DELTA_row, DOCSTART, stride_qt, stride_dot, C_row, T, W, a_hi,
                qk_scale,
                BM, True, EVEN, HAS_DOC, HAS_WINDOW, DOT_PREC,
            )  # fmt: skip
        for start_m in range(diag_end, full_end, BM):
            dk, dv, dcol = _dkdv_tile(
                dk, dv, dcol, k, v, ck, offs_n, offs_d, start_m, Q_ptr, DO_ptr, LSE_row,
                LOLSE_row, DELTA_row, DOCSTART, stride_qt, stride_dot, C_row, T, W, a_hi,
                qk_scale,
                BM, False, EVEN, HAS_DOC, HAS_WINDOW, DOT_PREC,
            )  # fmt: skip
        for start_m in range(tl.maximum(diag_end, full_end), end_g, BM):
            dk, dv, dcol = _dkdv_tile(
                dk, dv, dcol, k, v, ck, offs_n, offs_d, start_m, Q_ptr, DO_ptr, LSE_row,
                LOLSE_row, DELTA_row, DOCSTART, stride_qt, stride_dot, C_row, T, W, a_hi,
                qk_scale,
                BM, True, EVEN, HAS_DOC, HAS_WINDOW, DOT_PREC,
            )  # fmt: skip
        tl.store(DCOL + bh.to(tl.int64) * T + offs_n, dcol, mask=col_ok)
    dk = dk * scale
    DK_ptr = DK + b.to(tl.int64) * stride_dkb + hk * stride_dkh
    DV_ptr = DV + b.to(tl.int64) * stride_dvb + hk * stride_dvh
    tl.store(
        DK_ptr + offs_n[:, None] * stride_dkt + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=col_ok[:, None],
    )
    tl.store(
        DV_ptr + offs_n[:, None] * stride_dvt + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=col_ok[:, None],
    )


@triton.jit
def _kmax_kernel(
    K, V, KMAX, T, H, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    D: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """``KMAX[b, h] = max_t |K[b, t, h, :]|`` (float32, zero-initialised) for exact pruning,
    ``+inf`` where a key or value holds a NaN or inf: no tile is then pruned, and the NaN
    reaches every row it reaches without pruning (a pruned tile never computes ``0 * NaN``,
    and the atomic max drops a NaN norm).

    Program (t-block, b * H + h) reduces ``BT`` rows and folds its maximum in with an atomic
    max (norms are >= 0, so the float order is the integer order).
    """
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, D)
    ok = (rows < T)[:, None]
    K_ptr = K + b.to(tl.int64) * stride_kb + h * stride_kh
    V_ptr = V + b.to(tl.int64) * stride_vb + h * stride_vh
    k = tl.load(K_ptr + rows[:, None] * stride_kt + offs_d[None, :], mask=ok, other=0.0)
    v = tl.load(V_ptr + rows[:, None] * stride_vt + offs_d[None, :], mask=ok, other=0.0)
    k = k.to(tl.float32)
    norm = tl.sqrt(tl.sum(k * k, 1))
    finite = tl.sum(k * 0.0 + v.to(tl.float32) * 0.0, 1)  # NaN where a k or v entry is not finite
    norm = tl.where(finite == finite, norm, float("inf"))
    tl.atomic_max(KMAX + bh, tl.max(norm, 0), sem="relaxed")


@triton.jit
def _gate_cumsum_kernel(LF, C, RISES, T, HQ, BLOCK: tl.constexpr):
    """``C[b, h] = (hi, lo)`` of ``cumsum_t(LF[b, :, h]) * log2(e)`` summed in float64, and
    ``RISES[b * HQ + h]`` = 1 where some ``LF[b, t, h] > 0`` (the cumsum rises: exact pruning,
    which takes it to never rise, is then off for that head), else 0.

    ``LF`` ``[B, T, HQ]`` float32 (contiguous), ``C`` ``[B, HQ, 2, T]`` float32, ``RISES``
    ``[B * HQ]`` int32. One program per (batch, head) walks T in blocks, carrying the running
    float64 sum.
    """
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    LF_row = LF + b.to(tl.int64) * T * HQ + h
    C_row = C + bh.to(tl.int64) * 2 * T
    carry = tl.zeros([1], dtype=tl.float64)
    rises = tl.zeros([1], dtype=tl.int32)
    for t0 in range(0, T, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        ok = offs < T
        lf = tl.load(LF_row + offs * HQ, mask=ok, other=0.0).to(tl.float64)
        rises = tl.maximum(rises, tl.max((lf > 0).to(tl.int32), 0))
        c = tl.cumsum(lf, 0) + carry
        c = c * _LOG2E_HI + c * _LOG2E_LO
        hi = c.to(tl.float32)
        lo = (c - hi.to(tl.float64)).to(tl.float32)
        tl.store(C_row + offs, hi, mask=ok)
        tl.store(C_row + T + offs, lo, mask=ok)
        carry += tl.sum(lf, 0)
    tl.store(RISES + bh + tl.arange(0, 1), rises)


@triton.jit
def _same_document_sum(a, a_doc, b, b_doc):
    """Combine of a segmented scan: ``b`` plus ``a`` when both lie in one document (the same
    ``doc_end``); associative because each document is one run of positions."""
    return b + tl.where(a_doc == b_doc, a, 0.0), b_doc


@triton.jit
def _dlogf_kernel(DROW, DCOL, DOCEND, DLOGF, T, HQ, HAS_DOC: tl.constexpr, BLOCK: tl.constexpr):
    """``DLOGF[b, t, h] = sum_{t <= s < end_t} (DROW - DCOL)[b, h, s]`` (float64 sums, float32
    out), where ``end_t`` is T, or with packed documents ``DOCEND[t]`` (int32 ``[T]``): the
    reverse cumsum of d c restarting at each document's end.

    ``DROW``/``DCOL`` ``[B, HQ, T]`` float32, ``DLOGF`` ``[B, T, HQ]`` float32. One program per
    (batch, head) walks T backwards in blocks, carrying the running float64 sum of the document
    open at the block's start (a segmented scan within the block).
    """
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    row = bh.to(tl.int64) * T
    OUT_row = DLOGF + b.to(tl.int64) * T * HQ + h
    carry = tl.zeros([1], dtype=tl.float64)
    carry_doc = tl.full([1], -1, dtype=tl.int32)  # the document ``carry`` belongs to
    n_blocks = tl.cdiv(T, BLOCK)
    for i in range(0, n_blocks):
        first = (n_blocks - 1 - i) * BLOCK
        offs = first + tl.arange(0, BLOCK)
        ok = offs < T
        dc = tl.load(DROW + row + offs, mask=ok, other=0.0).to(tl.float64)
        dc -= tl.load(DCOL + row + offs, mask=ok, other=0.0).to(tl.float64)
        if HAS_DOC:
            doc = tl.load(DOCEND + offs, mask=ok, other=T)
            rev, _ = tl.associative_scan((dc, doc), 0, _same_document_sum, reverse=True)
            rev += tl.where(doc == carry_doc, carry, 0.0)
            carry = tl.sum(tl.where(offs == first, rev, 0.0), 0, keep_dims=True)
            carry_doc = tl.sum(tl.where(offs == first, doc, 0), 0, keep_dims=True)
        else:
            rev = tl.cumsum(dc, 0, reverse=True) + carry
            carry += tl.sum(dc, 0)
        tl.store(OUT_row + offs * HQ, rev.to(tl.float32), mask=ok)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _repaired_boundaries(CU, j, N1, T):
    """Boundaries ``CU[j]`` clamped into ``[0, T]``, the first taken as 0 and the last as T
    (int32; ``j`` past the list reads 0)."""
    r = tl.load(CU + j, mask=j < N1, other=0).to(tl.int64)  # int32 once inside [0, T]
    r = tl.minimum(tl.maximum(r, 0), T).to(tl.int32)
    return tl.where(j == 0, 0, tl.where(j == N1 - 1, T, r))


@triton.jit
def _doc_bounds_kernel(
    CU, N1, START, END, T, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr
):  # fmt: skip
    """``START[t]``, ``END[t]`` (int32 ``[T]``): the document ``[start, end)`` holding position
    ``t``, from the ``N1`` boundaries ``CU`` (int32/int64 ``cu_seqlens``) made well-formed on
    the way: each clamped into ``[0, T]``, the first taken as 0 and the last as T, and each
    raised to the largest before it (a well-formed ``CU`` is unchanged).

    With ``r`` those boundaries (non-decreasing), ``start = max(r_j <= t)`` and ``end =
    min(r_j > t)``. One program per ``BLOCK_T`` positions first skips, ``BLOCK_S`` at a time,
    the boundaries that all lie at or before its first position (they only raise ``start``:
    a running maximum), then reads the rest ``BLOCK_C`` at a time against each position and
    stops after the first chunk that passes its last position: later boundaries change
    nothing there. The skip keeps many short documents cheap: without it each program
    compared every earlier boundary against its positions (docs/benchmarks.md, "Packed
    documents").
    """
    first = tl.program_id(0) * BLOCK_T
    pos = first + tl.arange(0, BLOCK_T)
    last = tl.minimum(first + BLOCK_T, T) - 1
    top = first * 0  # the largest boundary read so far (int32)
    j0 = first * 0
    skipping = j0 == 0
    while skipping & (j0 < N1):
        widest = tl.max(_repaired_boundaries(CU, j0 + tl.arange(0, BLOCK_S), N1, T), 0)
        skipping = widest <= first
        top = tl.where(skipping, tl.maximum(top, widest), top)
        j0 = tl.where(skipping, j0 + BLOCK_S, j0)
    start = tl.zeros([BLOCK_T], dtype=tl.int32) + top
    end = tl.zeros([BLOCK_T], dtype=tl.int32) + T
    while (j0 < N1) & (top <= last):
        j = j0 + tl.arange(0, BLOCK_C)
        r = tl.where(j < N1, _repaired_boundaries(CU, j, N1, T), T)
        r = tl.maximum(tl.associative_scan(r, 0, _larger), top)
        below = r[None, :] <= pos[:, None]
        start = tl.maximum(start, tl.max(tl.where(below, r[None, :], 0), 1))
        end = tl.minimum(end, tl.min(tl.where(below, T, r[None, :]), 1))
        top = tl.max(r, 0)
        j0 += BLOCK_C
    ok = pos < T
    tl.store(START + pos, start, mask=ok)
    tl.store(END + pos, end, mask=ok)
