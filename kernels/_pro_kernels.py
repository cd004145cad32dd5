"""Triton jit kernels for the FoT (Pro) elementwise components (KV-shift, per-head RMSNorm,
output gate), forward and backward.

Conventions shared by every kernel here:

* Tensors ``[B, T, H, D]`` with a unit stride on D (other strides passed in); logits of the
  shift ``[B, T, H]`` (strided); per-head weights ``[H, D]`` contiguous; the reset mask
  ``[T]`` int8 (1 where a document starts).
* One program per (block of ``BT`` positions, b * H + h): a ``[BT, BD]`` tile, D padded to
  the power of two ``BD`` and masked. All math in float32 registers, one rounding per output.
* Forward kernels read their inputs and write the output; backward kernels read the same
  inputs and the output gradient and recompute everything else (nothing but the inputs is
  saved for backward).
* The shift backward needs ``dz`` at ``t + 1``: it recomputes the shifted row block (a second,
  offset load of the same rows, served by L1/L2) instead of launching a second kernel.
* Weight gradients: each program writes its partial sum over its ``BT`` rows into a float32
  buffer ``[n_blocks * B, H, D]``; the launcher sums it with one torch reduction
  (deterministic, no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_bwd(z, dn, D: tl.constexpr, eps):
    """Backward of ``n = z * rstd(z)`` along axis 1 given ``dn = dL/dn``.

    Returns ``(dz, n)`` with ``dz = rstd * (dn - n * mean_D(dn * n))`` (float32 ``[BT, BD]``).
    Padded columns of ``z``/``dn`` must be zero; they stay zero.
    """
    rstd = tl.rsqrt(tl.sum(z * z, axis=1) / D + eps)  # (BT,)
    n = z * rstd[:, None]
    proj = tl.sum(dn * n, axis=1) / D  # (BT,)
    dz = rstd[:, None] * (dn - n * proj[:, None])
    return dz, n


@triton.jit
def _tile(T, H, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    """This program's tile: ``(b, h, offs_t, offs_d, mask_t, mask_d, mask, rows)``.

    ``b`` and ``rows`` (``offs_t`` as an int64 column, for pointer arithmetic) are int64;
    ``mask`` is the ``[BT, BD]`` in-range mask.
    """
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    mask_t = offs_t < T
    mask_d = offs_d < D
    mask = mask_t[:, None] & mask_d[None, :]
    return b, h, offs_t, offs_d, mask_t, mask_d, mask, offs_t.to(tl.int64)[:, None]


@triton.jit
def _shift_norm_fwd_kernel(
    X,
    S,
    W,
    RESET,
    PREV,
    Y,
    sx_b,
    sx_t,
    sx_h,
    ss_b,
    ss_t,
    ss_h,
    sp_b,
    sp_h,
    T,
    H,
    eps,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESET: tl.constexpr,
    HAS_PREV: tl.constexpr,
):
    """``y = rmsnorm(z) * w`` (or ``z``), ``z_t = x_t + a_t (x_{t-1} - x_t)`` (or ``x``).

    ``x_{-1}`` is ``PREV`` ``[B, H, D]`` (strides ``sp_b``, ``sp_h``, unit on D) with
    ``HAS_PREV``, else zero. Y is contiguous ``[B, T, H, D]``.
    """
    b, h, offs_t, offs_d, mask_t, mask_d, mask, rows = _tile(T, H, D, BD, BT)
    rows = rows * sx_t
    x_ptr = X + b * sx_b + h * sx_h + rows + offs_d[None, :]
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)  # (BT, BD)
    z = x
    if HAS_SHIFT:
        s = tl.load(S + b * ss_b + offs_t * ss_t + h * ss_h, mask=mask_t, other=0.0)
        a = tl.sigmoid(s.to(tl.float32))  # (BT,)
        has_prev = mask_t & (offs_t > 0)
        if HAS_RESET:
            starts = tl.load(RESET + offs_t, mask=mask_t, other=1)
            has_prev = has_prev & (starts == 0)
        xp = tl.load(x_ptr - sx_t, mask=has_prev[:, None] & mask_d[None, :], other=0.0)
        xp = xp.to(tl.float32)
        if HAS_PREV:  # row 0 continues from the cached x_{-1}
            first = offs_t == 0
            if HAS_RESET:
                first = first & (starts == 0)
            p = tl.load(
                PREV + b * sp_b + h * sp_h + offs_d[None, :] + 0 * offs_t[:, None],
                mask=first[:, None] & mask_d[None, :],
                other=0.0,
            )
            xp += p.to(tl.float32)
        z = x + a[:, None] * (xp - x)
    y = z
    if HAS_NORM:
        w = tl.load(W + h * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)  # (BD,)
        rstd = tl.rsqrt(tl.sum(z * z, axis=1) / D + eps)  # (BT,)
        y = z * rstd[:, None] * w[None, :]
    y_ptr = Y + (b * T * H + h) * D + offs_t.to(tl.int64)[:, None] * (H * D) + offs_d[None, :]
    tl.store(y_ptr, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _shift_norm_bwd_kernel(
    X,
    S,
    W,
    RESET,
    DY,
    DX,
    DS,
    DW,
    sx_b,
    sx_t,
    sx_h,
    ss_b,
    ss_t,
    ss_h,
    sdy_b,
    sdy_t,
    sdy_h,
    sdx_b,
    sdx_t,
    sdx_h,
    sds_b,
    sds_t,
    sds_h,
    B,
    T,
    H,
    eps,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESET: tl.constexpr,
):
    """Gradients of :func:`_shift_norm_fwd_kernel` for x, the shift logits and the weight.

    ``dx_t = dz_t (1 - a_t) + [t+1 has a prev] a_{t+1} dz_{t+1}``,
    ``ds_t = a_t (1 - a_t) sum_D dz_t (x_{t-1} - x_t)``, ``dw = sum_{b,t} dy * n``.
    DX ``[B, T, H, D]`` and DS ``[B, T, H]`` with their own strides (unit stride on D), DW float32
    ``[n_blocks * B, H, D]`` (per-program partial sums).
    """
    b, h, offs_t, offs_d, mask_t, mask_d, mask, rows = _tile(T, H, D, BD, BT)
    x_ptr = X + b * sx_b + h * sx_h + rows * sx_t + offs_d[None, :]
    dy_ptr = DY + b * sdy_b + h * sdy_h + rows * sdy_t + offs_d[None, :]
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)  # (BT, BD)
    dy = tl.load(dy_ptr, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w = tl.load(W + h * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    z = x
    if HAS_SHIFT:
        s_ptr = S + b * ss_b + offs_t * ss_t + h * ss_h
        a = tl.sigmoid(tl.load(s_ptr, mask=mask_t, other=0.0).to(tl.float32))  # (BT,)
        has_prev = mask_t & (offs_t > 0)
        if HAS_RESET:
            starts = tl.load(RESET + offs_t, mask=mask_t, other=1)
            has_prev = has_prev & (starts == 0)
        xp = tl.load(x_ptr - sx_t, mask=has_prev[:, None] & mask_d[None, :], other=0.0)
        diff = xp.to(tl.float32) - x  # (BT, BD)
        z = x + a[:, None] * diff
    if HAS_NORM:
        dz, n = _rms_bwd(z, dy * w, D, eps)
        dw = tl.sum(dy * n, axis=0)  # (BD,) partial over this block's rows
        dw_ptr = DW + ((tl.program_id(0) * B + b) * H + h) * D + offs_d
        tl.store(dw_ptr, dw, mask=mask_d)
    else:
        dz = dy
    dx = dz
    if HAS_SHIFT:
        ds = a * (1.0 - a) * tl.sum(dz * diff, axis=1)  # (BT,)
        ds_ptr = DS + b * sds_b + offs_t.to(tl.int64) * sds_t + h * sds_h
        tl.store(ds_ptr, ds.to(DS.dtype.element_ty), mask=mask_t)
        # Rows t + 1, whose shift reads x_t: recompute their dz (offset loads hit L1/L2).
        offs_n = offs_t + 1
        has_next = offs_n < T
        if HAS_RESET:
            starts_n = tl.load(RESET + offs_n, mask=has_next, other=1)
            has_next = has_next & (starts_n == 0)
        mask_n = has_next[:, None] & mask_d[None, :]
        s_n = tl.load(s_ptr + ss_t, mask=has_next, other=0.0).to(tl.float32)
        a_n = tl.where(has_next, tl.sigmoid(s_n), 0.0)  # (BT,)
        dy_n = tl.load(dy_ptr + sdy_t, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_NORM:
            x_n = tl.load(x_ptr + sx_t, mask=mask_n, other=0.0).to(tl.float32)
            z_n = x_n + a_n[:, None] * (x - x_n)
            z_n = tl.where(mask_n, z_n, 0.0)
            dz_n, _ = _rms_bwd(z_n, dy_n * w, D, eps)
        else:
            dz_n = dy_n
        dx = dz * (1.0 - a)[:, None] + a_n[:, None] * dz_n
    dx_ptr = DX + b * sdx_b + h * sdx_h + rows * sdx_t + offs_d[None, :]
    tl.store(dx_ptr, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _norm_gate_fwd_kernel(
    OIN,
    G,
    W,
    Y,
    so_b,
    so_t,
    so_h,
    sg_b,
    sg_t,
    sg_h,
    T,
    H,
    eps,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """``y = rmsnorm(o) * w * sigmoid(g)`` (each factor only if present); Y contiguous."""
    b, h, _, offs_d, _, mask_d, mask, rows = _tile(T, H, D, BD, BT)
    o = tl.load(OIN + b * so_b + h * so_h + rows * so_t + offs_d[None, :], mask=mask, other=0.0)
    y = o.to(tl.float32)  # (BT, BD)
    if HAS_NORM:
        w = tl.load(W + h * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(y * y, axis=1) / D + eps)
        y = y * rstd[:, None] * w[None, :]
    if HAS_GATE:
        g = tl.load(G + b * sg_b + h * sg_h + rows * sg_t + offs_d[None, :], mask=mask, other=0.0)
        y = y * tl.sigmoid(g.to(tl.float32))
    y_ptr = Y + (b * T * H + h) * D + rows * (H * D) + offs_d[None, :]
    tl.store(y_ptr, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_gate_bwd_kernel(
    OIN,
    G,
    W,
    DY,
    DO,
    DG,
    DW,
    so_b,
    so_t,
    so_h,
    sg_b,
    sg_t,
    sg_h,
    sdy_b,
    sdy_t,
    sdy_h,
    sdg_b,
    sdg_t,
    sdg_h,
    B,
    T,
    H,
    eps,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Gradients of :func:`_norm_gate_fwd_kernel`: with ``n = o * rstd(o)``, ``sg = sigmoid(g)``,
    ``dg = dy * n * w * sg (1 - sg)``, ``dn = dy * w * sg`` (then the RMSNorm backward), and
    ``dw = sum_{b,t} dy * n * sg``. DO contiguous, DG with its own strides (unit stride on D);
    DW float32 ``[n_blocks * B, H, D]``.
    """
    b, h, _, offs_d, _, mask_d, mask, rows = _tile(T, H, D, BD, BT)
    o = tl.load(OIN + b * so_b + h * so_h + rows * so_t + offs_d[None, :], mask=mask, other=0.0)
    o = o.to(tl.float32)  # (BT, BD)
    dy = tl.load(DY + b * sdy_b + h * sdy_h + rows * sdy_t + offs_d[None, :], mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    out_off = (b * T * H + h) * D + rows * (H * D) + offs_d[None, :]
    dn = dy  # gradient w.r.t. the gate's input (the normed o, or o)
    if HAS_GATE:
        g = tl.load(G + b * sg_b + h * sg_h + rows * sg_t + offs_d[None, :], mask=mask, other=0.0)
        sg = tl.sigmoid(g.to(tl.float32))
        dn = dy * sg
    if HAS_NORM:
        w = tl.load(W + h * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        do, n = _rms_bwd(o, dn * w, D, eps)
        dw = tl.sum(dn * n, axis=0)  # (BD,)
        tl.store(DW + ((tl.program_id(0) * B + b) * H + h) * D + offs_d, dw, mask=mask_d)
        pre_gate = n * w
    else:
        do = dn
        pre_gate = o
    if HAS_GATE:
        dg = dy * pre_gate * sg * (1.0 - sg)
        dg_ptr = DG + b * sdg_b + h * sdg_h + rows * sdg_t + offs_d[None, :]
        tl.store(dg_ptr, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DO + out_off, do.to(DO.dtype.element_ty), mask=mask)
