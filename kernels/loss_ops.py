"""Fused linear cross-entropy: the LM head's GEMM and the softmax cross-entropy, chunk by chunk.

Layers: jit kernel -> per-chunk helpers -> private ``autograd.Function`` -> public
:func:`linear_cross_entropy`.

The ``[N, V]`` logits never exist whole. Per chunk of rows the forward computes the logits in
the GEMM dtype (bf16 under autocast), one Triton kernel per row computes the loss and writes
the logits' gradient ``softmax - onehot`` over the logits in place, and two GEMMs turn that
into the chunk's input gradient and add its weight gradient into a float32 buffer (16-bit
inputs, float32 accumulation and output: no TF32 and no float32 copies of the logits). The
backward only scales the saved gradients by the incoming scalar.

Weight rows at and beyond ``n_classes`` are padding (a vocabulary padded to a multiple of 64
keeps the GEMMs aligned): the kernel leaves them out of the softmax and gives them gradient 0.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import check_positive_int, differentiable_once, on_input_gpu
from .forgetting_attention import _interpreting

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_CHUNK_ROWS = 4096
"""Rows whose logits exist at once (``chunk_rows * V`` values in the GEMM dtype)."""
_BLOCK_COLS = 4096  # columns per step of the row loop on a GPU (32 under the interpreter)


@triton.jit
def _cross_entropy_rows_kernel(
    Logits, Labels, Loss, n_classes, n_cols, stride_l, ignore_index,
    BV: tl.constexpr, WRITE_GRAD: tl.constexpr,
):  # fmt: skip
    """One row: ``loss = logsumexp(x[:n_classes]) - x[label]`` (0 for ``ignore_index``, NaN
    for a label outside ``[0, n_classes)``); with ``WRITE_GRAD`` the row is overwritten by
    ``softmax(x) - onehot(label)`` (0 in the padding columns and in ignored rows)."""
    row = tl.program_id(0).to(tl.int64)
    ptr = Logits + row * stride_l
    label = tl.load(Labels + row).to(tl.int64)
    m = -float("inf")
    s = 0.0
    for start in range(0, n_classes, BV):
        cols = start + tl.arange(0, BV)
        x = tl.load(ptr + cols, mask=cols < n_classes, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < n_classes)
    target = tl.load(ptr + label, mask=in_range, other=float("nan")).to(tl.float32)
    tl.store(Loss + row, tl.where(ignored, 0.0, lse - target))
    if WRITE_GRAD:
        for start in range(0, n_cols, BV):
            cols = start + tl.arange(0, BV)
            x = tl.load(ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == label, p - 1.0, p)
            p = tl.where((cols < n_classes) & (label != ignore_index), p, 0.0)
            tl.store(ptr + cols, p.to(Logits.dtype.element_ty), mask=cols < n_cols)


def _rows_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, n_classes: int, ignore_index: int, grad: bool
) -> torch.Tensor:
    """Per-row losses ``[C]`` float32 of ``logits [C, V]``; with ``grad`` the logits are
    overwritten by their gradient (see the kernel). Triton on CUDA or under the interpreter."""
    C, V = logits.shape
    losses = torch.empty(C, dtype=torch.float32, device=logits.device)
    if logits.device.type == "cuda" or _interpreting():
        _cross_entropy_rows_kernel[(C,)](
            logits, labels, losses, n_classes, V, logits.stride(0), ignore_index,
            BV=_BLOCK_COLS if logits.device.type == "cuda" else 32, WRITE_GRAD=grad, num_warps=8,
        )  # fmt: skip
        return losses
    x = logits[:, :n_classes].float()
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < n_classes)
    lse = torch.logsumexp(x, dim=1)
    target = x.gather(1, labels.clamp(0, n_classes - 1)[:, None])[:, 0]
    target = torch.where(in_range, target, torch.full_like(target, float("nan")))
    losses.copy_(torch.where(ignored, torch.zeros_like(lse), lse - target))
    if grad:
        p = torch.exp(x - lse[:, None])
        rows = torch.nonzero(in_range & ~ignored)[:, 0]
        p[rows, labels[rows]] -= 1.0
        p[ignored] = 0.0
        logits[:, :n_classes] = p.to(logits.dtype)
        logits[:, n_classes:] = 0
    return losses


def _chunks(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_rows, n)) for s in range(0, n, chunk_rows)]


def _accumulate_weight_grad(dw: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """``dw [V, H] float32 += g.T @ x`` (``g [C, V]``, ``x [C, H]`` in the GEMM dtype): a 16-bit
    GEMM with float32 accumulation and output on CUDA, float32 math elsewhere."""
    if g.device.type == "cuda" and g.dtype != torch.float32:
        torch.addmm(dw, g.t(), x, torch.float32, out=dw)
    else:
        dw.addmm_(g.t().float(), x.float())


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    n_classes: int,
    ignore_index: int,
    chunk_rows: int,
    compute_dtype: torch.dtype,
    grad_hidden: bool,
    grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed loss and, as asked, the gradients of that sum for hidden and weight."""
    x_all = hidden.to(compute_dtype)
    w = weight.to(compute_dtype)
    grad = grad_hidden or grad_weight
    dx = torch.empty_like(x_all) if grad_hidden else None
    dw = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if grad_weight
        else None
    )
    losses = []
    for s, e in _chunks(hidden.shape[0], chunk_rows):
        x = x_all[s:e]
        logits = F.linear(x, w)  # (C, V) in compute_dtype
        losses.append(_rows_loss_and_grad(logits, labels[s:e], n_classes, ignore_index, grad))
        if dx is not None:
            torch.mm(logits, w, out=dx[s:e])
        if dw is not None:
            _accumulate_weight_grad(dw, logits, x)
    loss = torch.cat(losses).sum() if losses else hidden.new_zeros((), dtype=torch.float32)
    return loss, dx, dw


class _LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, n_classes, ignore_index, chunk_rows, compute_dtype):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            loss, dx, dw = _forward(
                hidden, weight, labels, n_classes, ignore_index, chunk_rows, compute_dtype,
                need_dx, need_dw,
            )  # fmt: skip
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.save_for_backward(dx, dw)
        return loss

    @staticmethod
    @differentiable_once(
        "linear_cross_entropy",
        "Use F.cross_entropy(F.linear(hidden, weight), labels, reduction='sum'), which has "
        "one (in a fot model, loss_impl='chunked').",
    )
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors
        grad_hidden = grad_weight = None
        if dx is not None:
            grad_hidden = (dx * grad_loss).to(ctx.hidden_dtype)
        if dw is not None:
            grad_weight = (dw * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


@on_input_gpu
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    n_classes: int | None = None,
    ignore_index: int = -100,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight[:n_classes].T`` against ``labels``, fused.

    The GEMMs run in the autocast dtype under autocast (else ``hidden``'s dtype); the softmax
    and the loss in float32 from the rounded logits, as ``F.cross_entropy(F.linear(hidden,
    weight).float(), labels)`` computes them. The gradients are computed in the forward, chunk
    by chunk (``chunk_rows`` rows of logits at a time): the input gradient in the GEMM dtype, the
    weight gradient accumulated in float32 over all rows.

    Args:
        hidden: ``[N, H]`` float16/bfloat16/float32 (e.g. the final norm's output).
        weight: ``[V, H]`` LM head, any of those dtypes; rows ``n_classes:`` are padding.
        labels: ``[N]`` integer targets in ``[0, n_classes)``, or ``ignore_index`` (no loss, no
            gradient). A label outside both makes the loss NaN.
        n_classes: real classes (default ``V``); padding rows get no probability and gradient 0.
        ignore_index: the label value that is skipped.
        chunk_rows: rows of logits materialised at once (memory ``chunk_rows * V`` values).

    Returns:
        The float32 scalar sum of the per-row losses (divide by the count of counted labels for
        the mean). Differentiable once in ``hidden`` and ``weight`` (a backward with
        ``create_graph=True`` raises); saved for backward: their gradients (``[N, H]`` in the
        GEMM dtype, ``[V, H]`` float32). Without autograd only the losses are computed.

    Raises:
        TypeError / ValueError: on malformed inputs (naming the argument and what to change).
    """
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES or t.dim() != 2:
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a 2-D float16/bfloat16/float32 tensor, got {got}")
    N, H = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(
            f"weight is {tuple(weight.shape)} but hidden is {tuple(hidden.shape)}: weight must "
            f"be [V, {H}] (one row per class)"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point:
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"labels must be an integer tensor [N] = [{N}], got {got}")
    if tuple(labels.shape) != (N,):
        raise ValueError(f"labels must have shape [{N}] (hidden's rows), got {tuple(labels.shape)}")
    for name, t in (("weight", weight), ("labels", labels)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}; move it")
    if n_classes is not None:
        check_positive_int("n_classes", n_classes)  # 2.5 was cut to 2
    n_classes = V if n_classes is None else int(n_classes)
    if n_classes > V:
        raise ValueError(f"n_classes must be in [1, {V}] (weight's rows), got {n_classes}")
    check_positive_int("chunk_rows", chunk_rows)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index must be an int (labels are integers), got {ignore_index!r}")
    if labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor [N] = [{N}], got {labels.dtype}")
    chunk_rows, ignore_index = int(chunk_rows), int(ignore_index)
    device = hidden.device.type
    compute_dtype = (
        torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    )
    labels = labels.long().contiguous()  # uint8 / int32 ids: gather takes int64 indices
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropyFn.apply(
            hidden, weight, labels, n_classes, ignore_index, chunk_rows, compute_dtype
        )
    with torch.autocast(device, enabled=False):
        loss, _, _ = _forward(
            hidden, weight, labels, n_classes, ignore_index, chunk_rows, compute_dtype,
            False, False,
        )  # fmt: skip
    return loss


__all__ = ["DEFAULT_CHUNK_ROWS", "linear_cross_entropy"]
