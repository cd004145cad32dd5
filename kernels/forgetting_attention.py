"""Public forgetting-attention entry point backed by the Triton kernels.

Layers: jit kernels (``_triton_kernels``) -> launchers (``_forward`` / ``_backward``) ->
``_ForgettingAttentionFn`` (autograd) -> :func:`forgetting_attention`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import _triton_kernels as kern
from .checks import check_inputs, differentiable_once, on_input_gpu

_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# Exact pruning margin in log2 units: exp2(x) underflows to exactly 0 in float32 for
# x < -150; 10 more units cover rounding in the bound.
_EXACT_PRUNE_LOG2 = 160.0
# CUDA caps a launch grid's second dimension at 65535; the kernels put B * heads there.
MAX_GRID_Y = 65535


# Triton reads TRITON_INTERPRET when it is imported (its language functions) and when a kernel
# is defined: set later (a notebook that imported fot.kernels first), the kernels would be
# compiled for a GPU and fail deep in Triton ("0 active drivers").
_BUILT_FOR_INTERPRETER = isinstance(tl.sum, InterpretedFunction) and isinstance(
    kern._fwd_kernel, InterpretedFunction
)


def _interpreting() -> bool:
    """Whether the Triton kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` now and
    when triton and ``fot.kernels`` were imported."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and _BUILT_FOR_INTERPRETER


@dataclass
class PruneStats:
    """Tile counts from the forward kernel, filled only when passed as ``stats=``.

    Attributes:
        tiles_total: (query tile, key tile) pairs in the causal/window/document range.
        tiles_skipped: pairs skipped by pruning (exact, or approximate with a threshold).
        calls: forward calls accumulated into this object.
        history: ``(tiles_total, tiles_skipped)`` of each call.

    The backward pass prunes too (with the final LSE, so at least as many tiles), but its
    counts are not recorded.
    """

    tiles_total: int = 0
    tiles_skipped: int = 0
    calls: int = 0
    history: list[tuple[int, int]] = field(default_factory=list)

    @property
    def skipped_fraction(self) -> float:
        """Fraction of tiles skipped (0 when nothing was counted)."""
        return self.tiles_skipped / self.tiles_total if self.tiles_total else 0.0


# Private tuning hook for benchmarks/attention.py --sweep: keys of _tile_sizes and
# "<kernel>_warps"/"<kernel>_stages"/"<kernel>_maxnreg" (kernel in fwd/dq/kv) override the
# defaults below.
_CONFIG_OVERRIDE: dict[str, int] = {}


def _tile_sizes(D: int) -> dict[str, int]:
    """Tile shapes. Under the interpreter, small tiles keep numpy arrays small."""
    if _interpreting():
        sizes = {"fwd_bm": 32, "fwd_bn": 32, "dq_bm": 32, "dq_bn": 32, "kv_bm": 32, "kv_bn": 32}
    elif D <= 64:
        sizes = {"fwd_bm": 128, "fwd_bn": 64, "dq_bm": 64, "dq_bn": 64, "kv_bm": 64, "kv_bn": 64}
    elif D <= 128:
        sizes = {
            "fwd_bm": 128,
            "fwd_bn": 128,
            "dq_bm": 128,
            "dq_bn": 128,
            "kv_bm": 64,
            "kv_bn": 128,
        }
    else:
        sizes = {"fwd_bm": 64, "fwd_bn": 32, "dq_bm": 64, "dq_bn": 32, "kv_bm": 32, "kv_bn": 64}
    sizes.update({key: val for key, val in _CONFIG_OVERRIDE.items() if key in sizes})
    for kern_name in ("fwd", "dq"):  # their unmasked key tiles end exactly at the query tile
        if sizes[f"{kern_name}_bm"] % sizes[f"{kern_name}_bn"]:
            raise ValueError(
                f"{kern_name}_bm={sizes[f'{kern_name}_bm']} must be a multiple of "
                f"{kern_name}_bn={sizes[f'{kern_name}_bn']}"
            )
    return sizes


def _launch_params(D: int) -> dict[str, dict[str, int]]:
    """Launch options per kernel on a GPU: ``num_warps``, ``num_stages`` and, where set,
    ``maxnreg`` (registers per thread)."""
    if _interpreting():
        return {name: {"num_warps": 4, "num_stages": 1} for name in ("fwd", "dq", "kv")}
    # Picked by `benchmarks/attention.py --sweep` on an H200 (B1 T16k, H12 D128 / H16 D64);
    # dQ with 4 stages from a later sweep of its stages (D=64 fwd+bwd 6.97 -> 6.84 ms); D=128
    # backward tiles from a sweep after the unmasked-tile and folded-bias changes (bwd 6.44 ->
    # 5.98 ms: 128-key dK/dV tiles, 128 x 128 dQ tiles). At D=64 the dK/dV and dQ kernels are
    # capped at 168 registers (199 and 211 uncapped; dQ with 3 stages to fit 3 programs in
    # shared memory): 3 programs per SM instead of 2, a few registers spilled, and the backward
    # at B1 T16k H24 7.39 -> 7.10 ms (dK/dV cap; 160: 7.25, 128: 8.73), then 7.02 with the
    # dQ cap (3.59 -> 3.29 -> 3.20 ms with pruning on). A capped forward spilled ~80 registers
    # and ran 18% slower; smaller forward tiles with 3-5 programs per SM, caps of 128/152 and
    # 32-query dK/dV tiles were slower too (sweep in docs/benchmarks.md, "Checked afterwards").
    if D <= 64:
        params = {"fwd": (4, 3, None), "dq": (4, 3, 168), "kv": (4, 3, 168)}
    elif D <= 128:
        params = {"fwd": (8, 3, None), "dq": (8, 2, None), "kv": (8, 3, None)}
    else:
        params = {"fwd": (8, 2, None), "dq": (8, 2, None), "kv": (8, 2, None)}
    out = {}
    for name, (warps, stages, regs) in params.items():
        opts = {
            "num_warps": _CONFIG_OVERRIDE.get(f"{name}_warps", warps),
            "num_stages": _CONFIG_OVERRIDE.get(f"{name}_stages", stages),
        }
        regs = _CONFIG_OVERRIDE.get(f"{name}_maxnreg", regs)
        if regs:  # an override of 0 removes the cap
            opts["maxnreg"] = regs
        out[name] = opts
    return out


@dataclass
class _Layout:
    """Per-call constants shared by forward and backward launchers."""

    B: int
    T: int
    HQ: int
    H: int
    D: int
    scale: float
    window: int
    has_doc: bool
    has_window: bool
    doc_start: torch.Tensor
    doc_end: torch.Tensor
    dot_prec: str
    kmax: torch.Tensor | None = None  # (B, H) max |k| (float32), set by the forward when pruning


def _doc_bounds(cu_seqlens: torch.Tensor | None, T: int, device: torch.device):
    """Per-position document start/end (int32 ``[T]``), computed on device without a sync.

    The boundaries are made well-formed first: each clamped into ``[0, T]``, the first set to 0
    and the last to T, and each raised to the largest before it. That leaves a well-formed
    ``cu_seqlens`` unchanged; a malformed one on the GPU (its contents are checked only with
    ``debug=True``: a host sync) gives the attention of those documents instead of kernels
    reading and writing outside q, k, v and their gradients (a boundary below 0 or past T made
    them do that). One launch (it was ~13 small torch ops per call)."""
    if cu_seqlens is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return dummy, dummy
    start = torch.empty(T, dtype=torch.int32, device=device)
    end = torch.empty(T, dtype=torch.int32, device=device)
    block_t, block_c, block_s = (32, 16, 32) if _interpreting() else (128, 32, 1024)
    cu = cu_seqlens.to(device).contiguous()  # the kernel reads it with stride 1
    kern._doc_bounds_kernel[(triton.cdiv(T, block_t),)](
        cu, cu.numel(), start, end, T, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_S=block_s
    )
    return start, end


def _gate_cumsum(log_fgate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T, HQ]`` float32 -> ``c * log2(e)`` as a float32 (hi, lo) pair ``[B, HQ, 2, T]``,
    and ``rises`` ``[B * HQ]`` int32: 1 for a (batch, head) with some ``log_fgate > 0`` (a
    gate above 1), whose c can rise, so exact pruning's bound does not hold there.

    The sum runs in float64; hi is its float32 rounding and lo the remainder, so kernels get
    c_i - c_j to ~float64 accuracy near the diagonal with float32 arithmetic only (float64
    arithmetic in the inner loop is slow on GPUs). One running sum over the packed sequence
    serves packed documents: only differences c_i - c_j within one document are used.
    """
    B, T, HQ = log_fgate.shape
    c = torch.empty((B, HQ, 2, T), dtype=torch.float32, device=log_fgate.device)
    rises = torch.empty(B * HQ, dtype=torch.int32, device=log_fgate.device)
    # One launch instead of ~9 small torch ops (transpose, casts, scan, split, stack); block
    # 4096 with 8 warps was the fastest of 1024-8192 on an H200.
    block, warps = (32, 1) if _interpreting() else (4096, 8)
    kern._gate_cumsum_kernel[(B * HQ,)](
        log_fgate.contiguous(), c, rises, T, HQ, BLOCK=block, num_warps=warps
    )
    return c, rises


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c: torch.Tensor,
    rises: torch.Tensor,
    lay: _Layout,
    prune_log2: float | None,
    stats: PruneStats | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, HQ, H, D = lay.B, lay.T, lay.HQ, lay.H, lay.D
    tiles = _tile_sizes(D)
    launch = _launch_params(D)["fwd"]
    bm, bn = tiles["fwd_bm"], tiles["fwd_bn"]
    # o in float32: the backward's delta = rowsum(dO * O) needs O unrounded (with a 16-bit O
    # the rounding dominates dq/dk under strong decay, where dS = P (dP - delta) cancels).
    # Storing a 16-bit o from the kernel instead (when no backward follows) made the D=128
    # forward slower on an H200 (2.14 -> 2.41 ms at B1 T16k H12), more than the cast costs.
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty((B, HQ, T), dtype=torch.float32, device=q.device)
    prune = prune_log2 is not None
    if prune:
        # max_t |k_t| per (batch, kv head): one launch (torch's norm + amax took ~3x longer)
        kmax = torch.zeros((B, H), dtype=torch.float32, device=q.device)
        bt = 32 if _interpreting() else 64
        kern._kmax_kernel[(triton.cdiv(T, bt), B * H)](
            k, v, kmax, T, H, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), D=D, BT=bt, num_warps=4,
        )  # fmt: skip
    else:
        kmax = lse  # unused
    n_m = triton.cdiv(T, bm)
    lay.kmax = kmax if prune else None
    stats_buf = (
        torch.zeros(B * HQ * n_m * 2, dtype=torch.int32, device=q.device)
        if stats is not None
        else lse
    )
    grid = (n_m, B * HQ)
    kern._fwd_kernel[grid](
        q,
        k,
        v,
        c,
        lay.doc_start,
        kmax,
        rises,
        o,
        lse,
        stats_buf,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        T,
        HQ,
        H,
        HQ // H,
        lay.scale * kern.LOG2E,
        lay.window,
        float(prune_log2) if prune else 0.0,
        D=D,
        BM=bm,
        BN=bn,
        HAS_DOC=lay.has_doc,
        HAS_WINDOW=lay.has_window,
        PRUNE=prune,
        STATS_ON=stats is not None,
        EVEN=T % bm == 0 and T % bn == 0,
        DOT_PREC=lay.dot_prec,
        **launch,
    )
    if stats is not None:
        counts = stats_buf.view(-1, 2).sum(0).tolist()  # host sync, only when asked
        stats.tiles_total += int(counts[0])
        stats.tiles_skipped += int(counts[1])
        stats.calls += 1
        stats.history.append((int(counts[0]), int(counts[1])))
    return o, lse


def _backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    c: torch.Tensor,
    rises: torch.Tensor,
    lse: torch.Tensor,
    lay: _Layout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, HQ, H, D = lay.B, lay.T, lay.HQ, lay.H, lay.D
    tiles = _tile_sizes(D)
    launch = _launch_params(D)
    do = do.contiguous()
    delta = torch.empty((B, HQ, T), dtype=torch.float32, device=q.device)  # dq kernel fills it
    lolse = torch.empty((B, HQ, T), dtype=torch.float32, device=q.device)  # dq kernel fills it
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dcol = torch.empty((B, HQ, T), dtype=torch.float32, device=q.device)
    drow = torch.empty((B, HQ, T), dtype=torch.float32, device=q.device)
    qk_scale = lay.scale * kern.LOG2E

    bm, bn = tiles["dq_bm"], tiles["dq_bn"]
    prune = lay.kmax is not None
    n_dq = triton.cdiv(T, bm)
    kfirst = torch.empty((B * HQ, n_dq), dtype=torch.int32, device=q.device) if prune else lse
    kern._bwd_dq_kernel[(n_dq, B * HQ)](
        q,
        k,
        v,
        c,
        lay.doc_start,
        do,
        o,
        lse,
        delta,
        lolse,
        dq,
        drow,
        lay.kmax if prune else lse,
        rises,
        kfirst,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        dq.stride(0),
        dq.stride(1),
        dq.stride(2),
        T,
        HQ,
        H,
        HQ // H,
        qk_scale,
        lay.scale,
        lay.window,
        _EXACT_PRUNE_LOG2,
        D=D,
        BM=bm,
        BN=bn,
        HAS_DOC=lay.has_doc,
        HAS_WINDOW=lay.has_window,
        PRUNE=prune,
        EVEN=T % bm == 0 and T % bn == 0,
        DOT_PREC=lay.dot_prec,
        **launch["dq"],
    )
    dq_bm = bm
    if prune:
        # Make each row of first-needed keys non-decreasing (suffix minimum): the dK/dV
        # kernel then stops at the first query tile that needs nothing of its key tile.
        kfirst = torch.flip(torch.cummin(torch.flip(kfirst, (-1,)), dim=-1).values, (-1,))
        kfirst = kfirst.contiguous()
    bm, bn = tiles["kv_bm"], tiles["kv_bn"]
    kern._bwd_dkdv_kernel[(triton.cdiv(T, bn), B * H)](
        q,
        k,
        v,
        c,
        lay.doc_start,
        lay.doc_end,
        do,
        lse,
        delta,
        lolse,
        dk,
        dv,
        dcol,
        kfirst,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        dk.stride(0),
        dk.stride(1),
        dk.stride(2),
        dv.stride(0),
        dv.stride(1),
        dv.stride(2),
        T,
        HQ,
        H,
        HQ // H,
        qk_scale,
        lay.scale,
        lay.window,
        n_dq,
        D=D,
        BM=bm,
        BN=bn,
        DQ_BM=dq_bm,
        HAS_DOC=lay.has_doc,
        HAS_WINDOW=lay.has_window,
        PRUNE=prune,
        EVEN=T % bm == 0 and T % bn == 0,
        DOT_PREC=lay.dot_prec,
        **launch["kv"],
    )
    # d c_t = sum_j dS_tj - sum_i dS_it. The query-side row sum is zero in exact arithmetic
    # (DESIGN.md §4) but not with delta = rowsum(dO * O) taken from the rounded 16-bit O:
    # keeping it cancels most of that rounding in d log f (fp16 test, strong decay: 7.6e-3 -> 3e-4).
    # d log f_l = sum_{t >= l, same document} d c_t: a reverse cumsum restarting per document.
    dlogf = torch.empty((B, T, HQ), dtype=torch.float32, device=q.device)
    # One launch (float64 running sums) instead of ~8 small torch ops; block 4096 with 8 warps,
    # as for the gate cumsum.
    block, warps = (32, 1) if _interpreting() else (4096, 8)
    kern._dlogf_kernel[(B * HQ,)](
        drow, dcol, lay.doc_end, dlogf, T, HQ, HAS_DOC=lay.has_doc, BLOCK=block, num_warps=warps
    )
    return dq, dk, dv, dlogf


class _ForgettingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_fgate, lay, prune_log2, stats, compute_dtype):
        out_dtype = q.dtype
        if compute_dtype is not None:
            q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        c, rises = _gate_cumsum(log_fgate)
        o, lse = _forward(q, k, v, c, rises, lay, prune_log2, stats)
        ctx.save_for_backward(q, k, v, o, c, rises, lse)
        ctx.lay = lay
        ctx.out_dtype = out_dtype
        return o.to(out_dtype)

    @staticmethod
    @differentiable_once(
        "forgetting_attention",
        "Use forgetting_attention_reference, which has one (in a fot model, attn_backend='reference' and loss_impl='chunked').",
    )
    def backward(ctx, do):
        q, k, v, o, c, rises, lse = ctx.saved_tensors
        dq, dk, dv, dlogf = _backward(do.to(q.dtype), q, k, v, o, c, rises, lse, ctx.lay)
        dt = ctx.out_dtype
        return dq.to(dt), dk.to(dt), dv.to(dt), dlogf, None, None, None, None


class _EmptyFn(torch.autograd.Function):
    """An empty output that autograd goes through like any other (with empty gradients), so
    that a loss over it can still call ``backward``; no kernel is launched."""

    @staticmethod
    def forward(ctx, q, k, v, log_fgate):
        ctx.save_for_backward(q, k, v, log_fgate)  # for the gradients' shapes and dtypes
        return q.new_empty(q.shape)

    @staticmethod
    def backward(ctx, do):
        return tuple(torch.zeros_like(t) for t in ctx.saved_tensors)


@on_input_gpu
def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window_size: int | None = None,
    prune: bool = True,
    prune_threshold: float | None = None,
    stats: PruneStats | None = None,
    debug: bool = False,
) -> torch.Tensor:
    """Causal forgetting attention, forward and backward in Triton.

    ``o_i = sum_{j<=i} softmax_j(q_i . k_j * scale + c_i - c_j) v_j`` with
    ``c = cumsum(log_fgate)`` over time (restarting at each ``cu_seqlens`` document).

    Args:
        q: ``[B, T, HQ, D]`` float16/bfloat16 (float32 accepted, for tests), on CUDA (or on
            CPU under ``TRITON_INTERPRET=1``). ``D`` in {16, 32, 64, 128, 256}.
        k: ``[B, T, H, D]``, same dtype; ``HQ % H == 0`` (grouped-query attention: query head
            ``h`` reads key/value head ``h // (HQ // H)``).
        v: ``[B, T, H, D]``.
        log_fgate: ``[B, T, HQ]`` float32, log of the forget gate, finite; usually ``<= 0``
            (``F.logsigmoid``), so that c never rises, which exact pruning's bound uses. A
            (batch, head) with some entry ``> 0`` (a gate above 1) is computed exactly too:
            the gate-cumsum kernel flags it (no host sync) and nothing is pruned there. With
            ``cu_seqlens`` one float64 cumsum runs over the whole packed row (only differences
            within a document are used), so a NaN or -inf gate makes every later document NaN
            too, and a sum beyond ~1e12 costs the later documents their precision. The kernel
            takes c relative to the first position of each query tile, in float32: a gate of
            ``log f = -x`` between that position and a query or key rounds its bias by up to
            ~5e-8 ``x`` (a reset of ``-1e4`` moves the output by ~4e-4; ``F.logsigmoid``
            outputs, above -100, by < 5e-6).
        scale: logit scale; default ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` int32/int64 document boundaries of packed sequences
            (``B == 1``); no attention and no gate cumsum across documents.
        window_size: query ``i`` sees keys ``i - window_size < j <= i`` only.
        prune: skip key tiles whose every weight underflows to zero, in the forward and the
            backward (exact: results are bitwise the same as with ``prune=False``; the bound
            uses ``|scale| * |q_i| * max_j |k_j|``, the falling gate cumsum and how far float32
            can round a score of that size (relative ~1e-5 at D=64); a head with a
            key or value that is not finite, or with a gate above 1, is not pruned, nor in the
            backward a query tile with a row of q or dO that is not finite). On by
            default. Where it can skip nothing, it still costs its bookkeeping: with 4096
            documents in 64k tokens, 1.01 against 0.79 ms per forward on an H100
            (docs/benchmarks.md, "Commit 9f65b24"), so ``False`` suits very short documents.
        prune_threshold: approximate pruning (natural-log units, e.g. ``-20.0``): also skip
            tiles whose bound on every weight is below ``e**prune_threshold`` times the
            row's largest weight among the keys of its query tile's span (at least its
            diagonal weight). Off (``None``) by default; only the forward pass is
            approximated (the backward prunes exactly and computes the gradient of the exact
            function).
        stats: a :class:`PruneStats` to accumulate tile counts into (costs a host sync;
            leave ``None`` in training).
        debug: validate that ``log_fgate`` is finite, and the contents of a ``cu_seqlens`` on
            the GPU (host syncs; on the CPU ``cu_seqlens`` is always checked). Unchecked, a
            malformed ``cu_seqlens`` (a first entry other than 0, a last other than T, a
            decrease) gives the result for its boundaries clamped into ``[0, T]``, the first
            set to 0, the last to T and none below the one before it: a wrong result, never
            a read or write outside the tensors.

    Under ``torch.compile`` in Triton's interpreter the call runs outside the graph (a graph
    break, which ``fullgraph=True`` refuses); the FoT model calls it through
    ``torch.compiler.disable`` on every device.

    Returns:
        ``[B, T, HQ, D]`` in q's dtype. Differentiable once in q, k, v and log_fgate (a
        backward with ``create_graph=True``, e.g. for a gradient penalty, raises; the
        reference has a second order). Saved for
        backward: q, k, v, a float32 copy of o (the backward's rowsum(dO * O) needs it
        unrounded), c (8 bytes per position and head), the LSE and one flag per head (a
        gate above 1).

    Raises:
        RuntimeError: on a CPU tensor without ``TRITON_INTERPRET=1`` (set before triton and
            this package were imported).
        ValueError / TypeError: on malformed inputs (see ``checks.check_inputs``).
    """
    if torch.compiler.is_compiling() and _interpreting():
        # Dynamo would trace Triton's interpreter (numpy) and fail: a graph break instead
        return _outside_compile(
            q, k, v, log_fgate, scale=scale, cu_seqlens=cu_seqlens, window_size=window_size,
            prune=prune, prune_threshold=prune_threshold, stats=stats, debug=debug,
        )  # fmt: skip
    check_inputs(q, k, v, log_fgate, cu_seqlens=cu_seqlens, window_size=window_size, debug=debug)
    B, T, HQ, D = q.shape
    H = k.shape[2]
    if q.device.type != "cuda" and not _interpreting():
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported (fot.kernels imports it), and "
                "Triton reads it at import: set it before the first import (in the shell, or "
                "first thing in the notebook) and restart Python, or use "
                f"fot.kernels.forgetting_attention_reference for tensors on {q.device}"
            )
        raise RuntimeError(
            f"forgetting_attention (Triton) needs CUDA tensors, got device {q.device}; use "
            "fot.kernels.forgetting_attention_reference on CPU (the model does this "
            "automatically), or set TRITON_INTERPRET=1 before importing triton to run the "
            "kernel in Triton's (slow) interpreter"
        )
    if D not in _SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {D} is not supported by the Triton kernel; use one of "
            f"{_SUPPORTED_HEAD_DIMS} (or forgetting_attention_reference)"
        )
    if q.dtype == torch.float64:
        raise TypeError(
            "forgetting_attention (Triton) takes float16/bfloat16/float32, got float64; use "
            "forgetting_attention_reference for float64"
        )
    if T * max(HQ, H) * D >= 2**31:
        raise ValueError(
            f"T * heads * head_dim = {T * HQ * D} overflows int32 offsets; split the sequence "
            "or the heads"
        )
    if prune_threshold is not None:
        if not prune:
            raise ValueError("prune_threshold needs prune=True")
        if not (isinstance(prune_threshold, (int, float)) and prune_threshold < 0):
            raise ValueError(
                f"prune_threshold must be a negative number (natural-log units, e.g. -20.0), "
                f"got {prune_threshold!r}"
            )
    if stats is not None and not isinstance(stats, PruneStats):
        raise TypeError(f"stats must be a fot.kernels.PruneStats or None, got {type(stats)}")
    if debug:
        bad = ~torch.isfinite(log_fgate)
        if bool(bad.any()):
            raise ValueError(
                f"log_fgate must be finite (the log of a forget gate), got {int(bad.sum())} "
                "NaN or infinite entries; use F.logsigmoid(gate_logits)"
            )
    if q.numel() == 0:  # B, T or HQ of 0 (head_dim >= 1 is checked above)
        return _EmptyFn.apply(q, k, v, log_fgate)
    if B * HQ > MAX_GRID_Y:
        # e.g. a large evaluation batch of short sequences: rows are independent, so run the
        # batch in parts that fit the grid (no cu_seqlens here: that needs B == 1)
        if HQ > MAX_GRID_Y:
            raise ValueError(f"{HQ} query heads exceed the kernels' grid limit of {MAX_GRID_Y}")
        rows = MAX_GRID_Y // HQ
        kw = {"scale": scale, "window_size": window_size, "prune": prune}
        kw.update(prune_threshold=prune_threshold, stats=stats)
        parts = [
            forgetting_attention(q[i : i + rows], k[i : i + rows], v[i : i + rows],
                                 log_fgate[i : i + rows], **kw)
            for i in range(0, B, rows)
        ]  # fmt: skip
        return torch.cat(parts)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    compute_dtype = None
    if _interpreting() and q.dtype == torch.bfloat16:
        # The interpreter's tl.dot multiplies raw bf16 bit patterns (DESIGN.md §4): upcast.
        compute_dtype = torch.float32
    has_doc = cu_seqlens is not None
    doc_start, doc_end = _doc_bounds(cu_seqlens, T, q.device)
    eff_dtype = compute_dtype or q.dtype
    lay = _Layout(
        B=B,
        T=T,
        HQ=HQ,
        H=H,
        D=D,
        scale=float(scale),
        # A window of T or more changes nothing (i - j < T): capped at T, so that the kernels'
        # int32 index math (key + window in the dK/dV kernel) cannot overflow.
        window=min(int(window_size), T) if window_size is not None else 0,
        has_doc=has_doc,
        has_window=window_size is not None,
        doc_start=doc_start,
        doc_end=doc_end,
        dot_prec="ieee" if eff_dtype == torch.float32 else "tf32",
    )
    if not prune:
        prune_log2 = None
    elif prune_threshold is None:
        prune_log2 = _EXACT_PRUNE_LOG2
    else:
        prune_log2 = min(-float(prune_threshold) * kern.LOG2E, _EXACT_PRUNE_LOG2)
    return _ForgettingAttentionFn.apply(q, k, v, log_fgate, lay, prune_log2, stats, compute_dtype)


_outside_compile = torch.compiler.disable(forgetting_attention)

__all__ = ["PruneStats", "forgetting_attention"]
