"""Input validation shared by the reference and the Triton kernels.

Errors name the offending argument, what was given and what to change. Checks that need a
device-to-host sync (the contents of cu_seqlens on a GPU) run only with ``debug=True``.
"""

from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Callable
from typing import TypeVar

import torch

_F = TypeVar("_F", bound=Callable)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_positive_int(name: str, value: object, *, none_ok: bool = False) -> None:
    """Refuse anything but an integer >= 1 (Python or NumPy; not a bool, which Python counts
    as an int: ``window_size=True`` would mean a window of 1), or None where ``none_ok``.

    Raises:
        ValueError: naming ``name`` and the value.
    """
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        what = "a positive int or None" if none_ok else "a positive int"
        raise ValueError(f"{name} must be {what}, got {value!r}")


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would differentiate through any of ``tensors`` (None entries are
    skipped): for kernels without a backward, which then leave the call to PyTorch."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (for sizing persistent or split
    launches; cached)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def on_input_gpu(fn: _F) -> _F:
    """Run ``fn`` with its first tensor argument's GPU as the current device.

    Triton launches a kernel on the *current* device's stream, not on its arguments' device:
    called with tensors on ``cuda:1`` while ``cuda:0`` is current (no ``torch.cuda.set_device``),
    a kernel would run on ``cuda:0`` and read ``cuda:1``'s memory while its stream may still be
    writing it. The backward needs nothing: autograd runs it with the device of its tensors set.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if (
            t is None
            or not t.is_cuda
            or torch.compiler.is_compiling()
            or t.device.index == torch.cuda.current_device()
        ):
            return fn(*args, **kwargs)
        with torch.cuda.device(t.device):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def differentiable_once(name: str, fix: str) -> Callable[[_F], _F]:
    """Mark an ``autograd.Function``'s backward as first order only: with ``create_graph=True``
    it raises, naming ``name`` and ``fix``.

    Its gradients come from kernels (or were computed in the forward) without a graph, so a
    gradient penalty or a Hessian-vector product through it would silently miss the second
    order. PyTorch's ``once_differentiable`` does not catch all of it: it raises only when the
    incoming gradient requires grad (not for a loss linear in the output, ``out.sum()``), and
    only when the second backward reaches its error node, which ``torch.autograd.grad(penalty,
    params)`` never does (that second order is then zero, silently). Raising at the
    ``create_graph=True`` backward itself catches both; the first-order backward pays one
    ``torch.is_grad_enabled()``.
    """

    def decorate(backward: _F) -> _F:
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled():  # backward runs in grad mode only for create_graph=True
                raise RuntimeError(
                    f"{name} is differentiable once: its backward builds no graph, so a "
                    "gradient taken with create_graph=True through it (a gradient penalty, a "
                    f"Hessian-vector product) would miss the second order. {fix}"
                )
            return backward(ctx, *grads)

        return wrapper  # type: ignore[return-value]

    return decorate


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    window_size: int | None = None,
    debug: bool = False,
) -> None:
    """Validate forgetting-attention inputs; raise ``ValueError``/``TypeError`` on misuse.

    Shapes: q ``[B, T, HQ, D]``, k/v ``[B, T, H, D]`` with ``HQ % H == 0``, log_fgate
    ``[B, T, HQ]`` float32 (or float64 with float64 q/k/v), cu_seqlens ``[N + 1]`` integer with ``B == 1``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape [B, T, heads, head_dim], got {tuple(t.shape)}; "
                "reshape (B, T, hidden) to (B, T, heads, hidden // heads)"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    # float32; float64 goes with float64 q/k/v (the reference path of a float64 model)
    gate_dtypes = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if not isinstance(log_fgate, torch.Tensor) or log_fgate.dtype not in gate_dtypes:
        got = log_fgate.dtype if isinstance(log_fgate, torch.Tensor) else type(log_fgate).__name__
        raise TypeError(
            f"log_fgate must be a float32 tensor (or float64, with float64 q/k/v), got {got}; "
            "compute the log-gate in fp32, e.g. F.logsigmoid(gate_logits.float())"
        )
    if not (q.device == k.device == v.device == log_fgate.device):
        raise ValueError(
            f"q, k, v, log_fgate must be on one device, got {q.device}, {k.device}, "
            f"{v.device}, {log_fgate.device}"
        )
    B, T, HQ, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(
            f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}: batch, length "
            "and head_dim must agree (only the number of heads may differ, for GQA). The layout "
            "is [B, T, heads, head_dim]: transpose(1, 2) tensors in SDPA's [B, heads, T, "
            "head_dim]; for fewer queries than keys (against a cache) use "
            "forgetting_attention_decode"
        )
    H = k.shape[2]
    if H == 0 or D == 0:
        raise ValueError(
            f"q/k/v need at least one key/value head and head_dim >= 1 ([B, T, heads, "
            f"head_dim]), got k of shape {tuple(k.shape)}"
        )
    if HQ % H != 0:
        raise ValueError(
            f"query heads ({HQ}) must be a multiple of key/value heads ({H}) for grouped-query "
            "attention"
        )
    if tuple(log_fgate.shape) != (B, T, HQ):
        if tuple(log_fgate.shape) == (B, HQ, T):
            # transposing log_fgate alone is wrong if q/k/v are the ones in the other layout
            hint = (
                "; if q is [B, T, heads, head_dim] (this function's layout), log_fgate is "
                "head-major: pass log_fgate.transpose(1, 2); if q is [B, heads, T, head_dim] "
                "(SDPA's layout), pass q, k and v transposed instead (.transpose(1, 2))"
            )
        elif tuple(log_fgate.shape) == (B, T, H):
            hint = (
                f"; for one gate per key/value head pass log_fgate.repeat_interleave({HQ // H}, "
                "dim=2) (query head h reads kv head h // (HQ // H))"
            )
        else:
            hint = ""
        raise ValueError(
            f"log_fgate must have shape [B, T, HQ] = {(B, T, HQ)} (one gate per query head), "
            f"got {tuple(log_fgate.shape)}{hint}"
        )
    check_positive_int("window_size", window_size, none_ok=True)
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(
                f"cu_seqlens (packed documents) needs batch size 1, got B={B}; pack the "
                "documents along the time axis"
            )
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(
                f"cu_seqlens must be a 1-D int32/int64 tensor, got {type(cu_seqlens).__name__}; "
                "pass torch.tensor(boundaries, dtype=torch.int32)"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"cu_seqlens must be a 1-D int32/int64 tensor, got shape "
                f"{tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}"
            )
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must have at least two entries [0, ..., T]")
        if debug or cu_seqlens.device.type == "cpu":  # no device sync on the CPU
            cs = cu_seqlens.tolist()
            if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in itertools.pairwise(cs)):
                raise ValueError(
                    f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got "
                    f"{cs[:8]}{'...' if len(cs) > 8 else ''}"
                )


def check_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_cumsum: torch.Tensor,
    k_cumsum: torch.Tensor,
    *,
    key_mask: torch.Tensor | None = None,
    window_size: int | None = None,
) -> None:
    """Validate decode inputs: q ``[B, Tq, HQ, D]``, caches ``[B, Tk, H, D]`` (floating, any
    mix of float dtypes), cumsums ``[B, Tq, HQ]`` / ``[B, Tk, HQ]`` float32/64, key_mask
    ``[B, Tk]`` bool, all on one device; window_size a positive int or None."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating tensor, got {got}")
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"decode expects q [B, Tq, HQ, D] and k/v caches [B, Tk, H, D] of equal shape, got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    B, Tq, HQ, D = q.shape
    Bk, Tk, H, Dk = k_cache.shape
    if H == 0 or D == 0:
        raise ValueError(
            f"decode needs at least one key/value head and head_dim >= 1, got q "
            f"{tuple(q.shape)} and caches {tuple(k_cache.shape)}"
        )
    if Bk != B or Dk != D or HQ % H != 0:
        raise ValueError(
            f"cache shape {tuple(k_cache.shape)} does not fit queries {tuple(q.shape)} (batch and "
            "head_dim must agree, query heads a multiple of kv heads); the layout is [B, T, "
            "heads, head_dim]: transpose(1, 2) tensors in SDPA's [B, heads, T, head_dim]"
        )
    if Tq > Tk:
        raise ValueError(
            f"decode has {Tq} queries but only {Tk} cached keys: append the new tokens' keys to "
            "the cache before attending"
        )
    for name, t, want in (("q_cumsum", q_cumsum, (B, Tq, HQ)), ("k_cumsum", k_cumsum, (B, Tk, HQ))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a float32/float64 tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.float64) or tuple(t.shape) != want:
            raise ValueError(
                f"{name} must be float32/float64 of shape {want}, got {t.dtype} {tuple(t.shape)}"
            )
    if not (q.device == k_cache.device == v_cache.device == q_cumsum.device == k_cumsum.device):
        raise ValueError(
            f"q, k_cache, v_cache, q_cumsum, k_cumsum must be on one device, got {q.device}, "
            f"{k_cache.device}, {v_cache.device}, {q_cumsum.device}, {k_cumsum.device}"
        )
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor):
            raise TypeError(
                f"key_mask must be a bool tensor or None, got {type(key_mask).__name__}"
            )
        if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, Tk):
            raise ValueError(
                f"key_mask must be bool of shape {(B, Tk)}, got {key_mask.dtype} "
                f"{tuple(key_mask.shape)}"
            )
        if key_mask.device != q.device:
            raise ValueError(f"key_mask is on {key_mask.device} but q is on {q.device}; move it")
    check_positive_int("window_size", window_size, none_ok=True)
