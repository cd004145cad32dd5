"""Fused FoT (Pro) components: KV-shift + per-head RMSNorm, and output norm + gate.

Layers: jit kernels (``_pro_kernels``) -> launchers (``_shift_norm_fwd`` ...) -> private
``autograd.Function``s -> public :func:`shift_norm` / :func:`norm_gate`.

Each component is one Triton kernel in forward and one in backward, with only the inputs saved
for backward (the backward kernel recomputes the shift and the norm), and float32 math in
registers with one rounding per output. On tensors that are not on CUDA, without
``TRITON_INTERPRET=1``, the same math runs as plain PyTorch (float32, autograd).
"""

from __future__ import annotations

import weakref

import torch
import triton

from . import _pro_kernels as kern
from .checks import differentiable_once, needs_grad, on_input_gpu
from .forgetting_attention import MAX_GRID_Y, _interpreting

MAX_HEAD_DIM = 256
"""Largest head_dim the kernels take (a ``[rows, head_dim]`` tile lives in registers)."""

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Private tuning hook (like forgetting_attention._CONFIG_OVERRIDE): keys "fwd_elems",
# "bwd_elems" (rows * padded head_dim per program) and "fwd_warps", "bwd_warps".
_CONFIG_OVERRIDE: dict[str, int] = {}


def _use_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" or _interpreting()


def _launch(D: int, kind: str) -> tuple[int, int, int]:
    """``(BD, BT, num_warps)`` for a forward (``kind="fwd"``) or backward kernel.

    A program holds ``BT x BD`` float32 values per live tile: 4096 elements in forward (about
    three tiles live) and 2048 in backward (about ten: the shift backward recomputes the next
    rows). At D=128 in bf16 a forward program moves ~24 KB, a backward ~24 KB. Registers per
    thread from an offline sm_90 compile (triton 3.7.1, bf16, D=128, 16-byte aligned strides
    as the JIT specialises them; no spills): forward 60 (shift+norm) / 60 (norm+gate),
    backward 127 (shift+norm) / 72 (norm+gate): 4 or more programs of 4 warps per SM. Timed
    only inside the 760M training step on an H200 (all four components of 24 layers, forward
    and backward: 10.1 ms per step at T=16k); not swept (``_CONFIG_OVERRIDE`` is there for it).
    """
    bd = triton.next_power_of_2(D)
    if _interpreting():
        elems, warps = 64 * bd, 4  # few, large programs: the interpreter's cost is per program
    else:
        elems, warps = (4096, 4) if kind == "fwd" else (2048, 4)
    elems = _CONFIG_OVERRIDE.get(f"{kind}_elems", elems)
    warps = _CONFIG_OVERRIDE.get(f"{kind}_warps", warps)
    bt = max(1, min(128, elems // bd))
    return bd, triton.next_power_of_2(bt), warps


# ---------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------


def _check_main(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(
            f"{name} must have shape [B, T, H, D], got {tuple(x.shape)}; view a (B, T, H * D) "
            "projection as (B, T, H, D)"
        )
    if x.dtype not in _KERNEL_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16 or float32, got {x.dtype}; cast it (the math "
            "runs in float32 either way)"
        )
    if x.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"{name} head_dim {x.shape[-1]} exceeds the supported maximum {MAX_HEAD_DIM}; use "
            "the plain PyTorch composition for larger heads"
        )


def _check_float(name: str, t: torch.Tensor, shape: tuple[int, ...], ref: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but the input is on {ref.device}; move it")


def _check_eps(eps: float) -> None:
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")


def _check_weight(weight: torch.Tensor | None, x: torch.Tensor) -> None:
    if weight is not None:
        H, D = x.shape[2:]
        _check_float("weight", weight, (H, D), x)


# ---------------------------------------------------------------------------------------
# One gradient buffer for the column slices of a projection output
# ---------------------------------------------------------------------------------------


class ColumnGrads:
    """The gradient of a projection output ``y`` ``[B, T, N]`` whose column slices feed
    separate kernels, assembled in one buffer instead of concatenated.

    Autograd gives each slice of ``y.split(...)`` its own gradient and concatenates them in
    the split's backward: one more read and write of ``y``'s whole gradient. With the
    ``ColumnGrads`` of :func:`split_columns`, the backward kernels of :func:`shift_norm` and
    :func:`norm_gate` write their input gradients straight into the matching columns of one
    ``[B, T, N]`` buffer, and the split's backward returns that buffer; gradients of slices
    that came from elsewhere are copied in. Each column range is handed out once per backward
    (a second consumer of the same columns gets a buffer of its own, so nothing is
    overwritten). Only ``y``'s layout and a weak reference to it are kept, not ``y``.

    Only views of ``y`` itself are claimed, while ``y`` lives. Under activation checkpointing
    ``y`` is freed after the forward and the backward's inputs are views of a recomputed copy:
    those get memory of their own, even when the copy lands at ``y``'s old address. (Whether
    it does depends on the allocator's state; were that to decide the path, the kernels would
    run with other strides from one step to the next, compiled differently, and gradients
    could differ in the last bit between otherwise identical runs.)
    """

    def __init__(self, y: torch.Tensor) -> None:
        if y.dim() != 3 or not y.is_contiguous():
            raise ValueError(f"y must be a contiguous [B, T, N] tensor, got {tuple(y.shape)}")
        self.shape, self.dtype, self.device = tuple(y.shape), y.dtype, y.device
        self._y = weakref.ref(y)  # dead once y is freed (activation checkpointing)
        self._storage = y.untyped_storage().data_ptr()
        self._offset = y.storage_offset()
        self.buffer: torch.Tensor | None = None
        self._claimed: list[tuple[int, int]] = []  # column ranges handed out

    def claim(self, t: torch.Tensor) -> torch.Tensor | None:
        """The buffer's columns under ``t`` (same shape and strides), or None.

        None unless ``y`` is alive and ``t`` is a view of it (same storage and dtype) that covers whole rows'
        column ranges (``[B, T, ...]`` with ``y``'s batch and row strides and a contiguous
        rest), and its columns were not handed out before in this backward.
        """
        B, T, N = self.shape
        if (
            self._y() is None
            or t.untyped_storage().data_ptr() != self._storage
            or t.dtype != self.dtype
            or t.dim() < 3
            or tuple(t.shape[:2]) != (B, T)
            or t.stride()[:2] != (T * N, N)
            or not t[0, 0].is_contiguous()
        ):
            return None
        start = t.storage_offset() - self._offset
        stop = start + t[0, 0].numel()
        if not 0 <= start < stop <= N or any(a < stop and start < b for a, b in self._claimed):
            return None
        if self.buffer is None:
            self.buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self._claimed.append((start, stop))
        return self.buffer.as_strided(t.shape, t.stride(), self.buffer.storage_offset() + start)

    def take(self) -> torch.Tensor:
        """The buffer (new memory if nobody claimed any columns); ``self`` starts afresh, so a
        second backward of the same graph (``retain_graph``) hands out new memory."""
        buf = self.buffer
        if buf is None:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.buffer, self._claimed = None, []
        return buf


def _grad_like(t: torch.Tensor, grads: ColumnGrads | None) -> torch.Tensor:
    """Where the gradient of ``t`` goes: ``grads``' buffer if it takes ``t``, else new memory."""
    out = grads.claim(t) if grads is not None else None
    return out if out is not None else torch.empty(t.shape, dtype=t.dtype, device=t.device)


class _SplitColumnsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, sizes, grads):
        ctx.sizes, ctx.grads = sizes, grads
        ctx.set_materialize_grads(False)
        return tuple(y.split(sizes, dim=-1))

    @staticmethod
    def backward(ctx, *douts):
        buf = ctx.grads.take()
        start = 0
        for d, n in zip(douts, ctx.sizes, strict=True):
            cols = buf[..., start : start + n]
            if d is None:
                cols.zero_()
            elif not (
                d.data_ptr() == cols.data_ptr()
                and d.shape == cols.shape
                and d.stride() == cols.stride()
            ):
                cols.copy_(d)  # not written in place by a consumer
            start += n
        return buf, None, None


def split_columns(
    y: torch.Tensor, sizes: list[int]
) -> tuple[tuple[torch.Tensor, ...], ColumnGrads]:
    """``y.split(sizes, dim=-1)``, plus the :class:`ColumnGrads` its consumers write into.

    Args:
        y: ``[B, T, N]`` contiguous projection output (e.g. q, k, v and the gates side by side).
        sizes: column widths summing to ``N``.

    Returns:
        ``(parts, grads)``: the column slices (views of ``y``) and the buffer to pass as
        ``grads=`` to :func:`shift_norm` / :func:`norm_gate` calls on them. The backward gives
        ``y`` one ``[B, T, N]`` gradient, assembled in place where the consumers allowed it.
    """
    if sum(sizes) != y.shape[-1]:
        raise ValueError(f"sizes {list(sizes)} must sum to y's last dim {y.shape[-1]}")
    grads = ColumnGrads(y)
    return _SplitColumnsFn.apply(y, tuple(sizes), grads), grads


# ---------------------------------------------------------------------------------------
# Shift + norm
# ---------------------------------------------------------------------------------------


def _dummy(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=x.device)


def _shift_norm_fwd(x, s, w, reset, eps, prev=None):
    B, T, H, D = x.shape
    bd, bt, warps = _launch(D, "fwd")
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    has_shift, has_norm = s is not None, w is not None
    s_ = s if has_shift else _dummy(x)
    ss = s.stride() if has_shift else (0, 0, 0)
    has_prev = prev is not None and has_shift
    grid = (triton.cdiv(T, bt), B * H)
    kern._shift_norm_fwd_kernel[grid](
        x,
        s_,
        w if has_norm else _dummy(x),
        reset if reset is not None else _dummy(x),
        prev if has_prev else _dummy(x),
        y,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        *ss,
        *(prev.stride()[:2] if has_prev else (0, 0)),
        T,
        H,
        float(eps),
        D=D,
        BD=bd,
        BT=bt,
        HAS_SHIFT=has_shift,
        HAS_NORM=has_norm,
        HAS_RESET=reset is not None,
        HAS_PREV=has_prev,
        num_warps=warps,
    )
    return y


def _shift_norm_bwd(dy, x, s, w, reset, eps, need_dw, grads):
    B, T, H, D = x.shape
    bd, bt, warps = _launch(D, "bwd")
    n_t = triton.cdiv(T, bt)
    has_shift, has_norm = s is not None, w is not None
    dx = _grad_like(x, grads)
    ds = _grad_like(s, grads) if has_shift else _dummy(x)
    dw_part = (
        torch.empty((n_t * B, H, D), dtype=torch.float32, device=x.device)
        if has_norm
        else _dummy(x)
    )
    ss = s.stride() if has_shift else (0, 0, 0)
    kern._shift_norm_bwd_kernel[(n_t, B * H)](
        x,
        s if has_shift else _dummy(x),
        w if has_norm else _dummy(x),
        reset if reset is not None else _dummy(x),
        dy,
        dx,
        ds,
        dw_part,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        *ss,
        dy.stride(0),
        dy.stride(1),
        dy.stride(2),
        *dx.stride()[:3],
        *(ds.stride() if has_shift else (0, 0, 0)),
        B,
        T,
        H,
        float(eps),
        D=D,
        BD=bd,
        BT=bt,
        HAS_SHIFT=has_shift,
        HAS_NORM=has_norm,
        HAS_RESET=reset is not None,
        num_warps=warps,
    )
    dw = dw_part.sum(0).to(w.dtype) if has_norm and need_dw else None
    return dx, (ds if has_shift else None), dw


class _ShiftNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s, w, reset, eps, grads):
        ctx.save_for_backward(x, s, w, reset)
        ctx.eps, ctx.grads = eps, grads
        return _shift_norm_fwd(x, s, w, reset, eps)

    @staticmethod
    @differentiable_once(
        "shift_norm",
        "Use the PyTorch token shift and RMSNorm, which have one (in a fot model, attn_backend='reference' and loss_impl='chunked').",
    )
    def backward(ctx, dy):
        x, s, w, reset = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        need_dw = ctx.needs_input_grad[2]
        dx, ds, dw = _shift_norm_bwd(dy, x, s, w, reset, ctx.eps, need_dw, ctx.grads)
        return dx, ds, dw, None, None, None


def _shift_norm_torch(x, s, w, reset, eps, prev=None):
    """The same math in PyTorch (float32, autograd), for devices without Triton."""
    z = x.float()
    if s is not None:
        first = torch.zeros_like(z[:, :1]) if prev is None else prev[:, None].float()
        prev = torch.cat([first, z[:, :-1]], dim=1)  # (B, T, H, D)
        if reset is not None:
            prev = prev.masked_fill(reset[None, :, None, None], 0.0)
        a = torch.sigmoid(s.float())[..., None]  # (B, T, H, 1)
        z = z + a * (prev - z)
    if w is not None:
        z = z * torch.rsqrt(z.square().mean(-1, keepdim=True) + eps) * w.float()
    return z.to(x.dtype)


@on_input_gpu
def shift_norm(
    x: torch.Tensor,
    shift_logits: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    reset: torch.Tensor | None = None,
    grads: ColumnGrads | None = None,
    prev: torch.Tensor | None = None,
) -> torch.Tensor:
    """Data-dependent token shift, then per-head RMSNorm, in one kernel (each part optional).

    ``z_t = x_t + sigmoid(s_t) * (x_{t-1} - x_t)`` with ``x_{-1} = prev`` (zero without
    ``prev``) and ``x_{t-1} := 0``
    where ``reset[t]``; ``y = z / sqrt(mean_D(z^2) + eps) * weight``. Without ``shift_logits``
    ``z = x`` (norm only); without ``weight`` ``y = z`` (shift only).

    All math runs in float32 with one rounding to x's dtype at the end. The PyTorch
    composition in ``fot.models.modeling_fot`` rounds in between (``a`` and the shifted ``z``
    to x's dtype, the normalised value before the weight): in bfloat16 results differ by
    about one bfloat16 rounding step; in float32 they agree to float32 accuracy.

    Args:
        x: ``[B, T, H, D]`` float16/bfloat16/float32, unit stride on D (other strides free:
            a view of a ``[B, T, H * D]`` projection is fine); ``D <= 256``.
        shift_logits: ``[B, T, H]`` any float dtype (logits of the mixing weight ``a_t``), or
            None for the norm only.
        weight: ``[H, D]`` per-head RMSNorm weight (any float dtype), or None for the shift
            only. At least one of ``shift_logits`` / ``weight`` must be given.
        eps: added to the mean square.
        reset: ``[T]`` bool, True where a document starts (shared by the batch), or None.
        grads: when x and shift_logits are column slices of one projection output, its
            :class:`ColumnGrads`: their gradients are then written into its shared buffer.
        prev: ``[B, H, D]`` any float dtype, the pre-shift value before ``x[:, 0]`` (a decode
            cache's last ``x``), or None for zero; read only with ``shift_logits``. The kernel
            takes it where nothing needs a gradient (a cached decode step); under autograd the
            PyTorch composition runs instead, differentiable in ``prev`` as well.

    Returns:
        ``[B, T, H, D]`` contiguous, in x's dtype. Differentiable in x, shift_logits (gradient
        in its dtype) and weight (float32 reduction over B and T, then weight's dtype); once
        on the Triton path (a backward with ``create_graph=True`` raises). Saved for
        backward: the inputs only.

    Raises:
        TypeError / ValueError: on malformed inputs (naming the argument and what to change).
    """
    _check_main("x", x)
    B, T, H = x.shape[:3]
    if shift_logits is None and weight is None:
        raise ValueError(
            "shift_norm needs shift_logits or weight (or both); with neither it is the identity"
        )
    if shift_logits is not None:
        _check_float("shift_logits", shift_logits, (B, T, H), x)
    _check_weight(weight, x)
    _check_eps(eps)
    if reset is not None:
        if not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool:
            got = reset.dtype if isinstance(reset, torch.Tensor) else type(reset).__name__
            raise TypeError(f"reset must be a bool tensor [T] (True at document starts), got {got}")
        if tuple(reset.shape) != (T,):
            raise ValueError(f"reset must have shape [T] = ({T},), got {tuple(reset.shape)}")
        if reset.device != x.device:
            raise ValueError(f"reset is on {reset.device} but x is on {x.device}; move it")
        if shift_logits is None:
            reset = None  # only the shift reads it
    if prev is not None:
        _check_float("prev", prev, (B, H, x.shape[3]), x)
        if shift_logits is None:
            prev = None  # only the shift reads it
    # an empty x: PyTorch keeps it differentiable; B * H beyond the grid's limit: PyTorch too;
    # prev under autograd: the kernels' backward takes x_{-1} = 0
    if (
        not _use_triton(x)
        or x.numel() == 0
        or B * H > MAX_GRID_Y
        or (prev is not None and needs_grad(x, shift_logits, weight, prev))
    ):
        return _shift_norm_torch(x, shift_logits, weight, reset, eps, prev)
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = weight.contiguous() if weight is not None else None
    r = reset.contiguous().view(torch.int8) if reset is not None else None
    if prev is not None:  # no gradient needed (above)
        p = prev if prev.stride(-1) == 1 else prev.contiguous()
        return _shift_norm_fwd(x, shift_logits, w, r, float(eps), p)
    return _ShiftNormFn.apply(x, shift_logits, w, r, float(eps), grads)


# ---------------------------------------------------------------------------------------
# Norm + gate
# ---------------------------------------------------------------------------------------


def _norm_gate_fwd(o, g, w, eps):
    B, T, H, D = o.shape
    bd, bt, warps = _launch(D, "fwd")
    y = torch.empty((B, T, H, D), dtype=o.dtype, device=o.device)
    has_gate, has_norm = g is not None, w is not None
    sg = g.stride()[:3] if has_gate else (0, 0, 0)
    kern._norm_gate_fwd_kernel[(triton.cdiv(T, bt), B * H)](
        o,
        g if has_gate else _dummy(o),
        w if has_norm else _dummy(o),
        y,
        o.stride(0),
        o.stride(1),
        o.stride(2),
        *sg,
        T,
        H,
        float(eps),
        D=D,
        BD=bd,
        BT=bt,
        HAS_GATE=has_gate,
        HAS_NORM=has_norm,
        num_warps=warps,
    )
    return y


def _norm_gate_bwd(dy, o, g, w, eps, need_dw, grads):
    B, T, H, D = o.shape
    bd, bt, warps = _launch(D, "bwd")
    n_t = triton.cdiv(T, bt)
    has_gate, has_norm = g is not None, w is not None
    do = torch.empty((B, T, H, D), dtype=o.dtype, device=o.device)
    dg = _grad_like(g, grads) if has_gate else _dummy(o)
    dw_part = (
        torch.empty((n_t * B, H, D), dtype=torch.float32, device=o.device)
        if has_norm
        else _dummy(o)
    )
    sg = g.stride()[:3] if has_gate else (0, 0, 0)
    kern._norm_gate_bwd_kernel[(n_t, B * H)](
        o,
        g if has_gate else _dummy(o),
        w if has_norm else _dummy(o),
        dy,
        do,
        dg,
        dw_part,
        o.stride(0),
        o.stride(1),
        o.stride(2),
        *sg,
        dy.stride(0),
        dy.stride(1),
        dy.stride(2),
        *(dg.stride()[:3] if has_gate else (0, 0, 0)),
        B,
        T,
        H,
        float(eps),
        D=D,
        BD=bd,
        BT=bt,
        HAS_GATE=has_gate,
        HAS_NORM=has_norm,
        num_warps=warps,
    )
    dw = dw_part.sum(0).to(w.dtype) if has_norm and need_dw else None
    return do, (dg if has_gate else None), dw


class _NormGateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, g, w, eps, grads):
        ctx.save_for_backward(o, g, w)
        ctx.eps, ctx.grads = eps, grads
        return _norm_gate_fwd(o, g, w, eps)

    @staticmethod
    @differentiable_once(
        "norm_gate",
        "Use the PyTorch RMSNorm and sigmoid gate, which have one (in a fot model, attn_backend='reference' and loss_impl='chunked').",
    )
    def backward(ctx, dy):
        o, g, w = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        do, dg, dw = _norm_gate_bwd(dy, o, g, w, ctx.eps, ctx.needs_input_grad[2], ctx.grads)
        return do, dg, dw, None, None


def _norm_gate_torch(o, g, w, eps):
    """The same math in PyTorch (float32, autograd), for devices without Triton."""
    y = o.float()
    if w is not None:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps) * w.float()
    if g is not None:
        y = y * torch.sigmoid(g.float())
    return y.to(o.dtype)


@on_input_gpu
def norm_gate(
    o: torch.Tensor,
    gate_logits: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    grads: ColumnGrads | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm and sigmoid output gate in one kernel (each part optional).

    ``y = o / sqrt(mean_D(o^2) + eps) * weight * sigmoid(gate_logits)``; without ``weight``
    there is no norm (``y = o * sigmoid(gate_logits)``), without ``gate_logits`` no gate.
    Float32 math, one rounding to o's dtype (the PyTorch composition rounds the normalised
    value and the gate to o's dtype first: about one bfloat16 step of difference).

    Args:
        o: ``[B, T, H, D]`` float16/bfloat16/float32, unit stride on D; ``D <= 256``.
        gate_logits: ``[B, T, H, D]`` any float dtype with a unit stride on D, or None.
        weight: ``[H, D]`` per-head norm weight (any float dtype), or None. At least one of
            ``gate_logits`` / ``weight`` must be given.
        eps: added to the mean square.
        grads: when gate_logits is a column slice of a projection output, its
            :class:`ColumnGrads`: the gate's gradient is then written into its shared buffer.

    Returns:
        ``[B, T, H, D]`` contiguous, in o's dtype. Differentiable in o, gate_logits (its
        dtype) and weight (float32 reduction, then weight's dtype); once on the Triton path
        (a backward with ``create_graph=True`` raises). Saved for backward: the inputs only.

    Raises:
        TypeError / ValueError: on malformed inputs (naming the argument and what to change).
    """
    _check_main("o", o)
    if gate_logits is None and weight is None:
        raise ValueError(
            "norm_gate needs gate_logits or weight (or both); with neither it is the identity"
        )
    if gate_logits is not None:
        _check_float("gate_logits", gate_logits, tuple(o.shape), o)
    _check_weight(weight, o)
    _check_eps(eps)
    # an empty o: PyTorch keeps it differentiable; B * H beyond the grid's limit: PyTorch too
    if not _use_triton(o) or o.numel() == 0 or o.shape[0] * o.shape[2] > MAX_GRID_Y:
        return _norm_gate_torch(o, gate_logits, weight, eps)
    if o.stride(-1) != 1:
        o = o.contiguous()
    if gate_logits is not None and gate_logits.stride(-1) != 1:
        gate_logits = gate_logits.contiguous()
    w = weight.contiguous() if weight is not None else None
    return _NormGateFn.apply(o, gate_logits, w, float(eps), grads)


__all__ = ["MAX_HEAD_DIM", "ColumnGrads", "norm_gate", "shift_norm", "split_columns"]
