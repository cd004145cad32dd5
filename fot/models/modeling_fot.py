"""Forgetting Transformer (FoT) language models and their Transformer baselines.

One block, read top to bottom (Lin et al., "Forgetting Transformer", ICLR 2025, §3 / App. A):

    x = x + o_proj(OutGate(OutNorm(ForgettingAttention(QKNorm(KVShift(q, k, v)), log f))))
    x = x + SwiGLU(RMSNorm(x))

* FoT (LLaMA): forget gate ``full``, no RoPE, no Pro components.
* FoT (Pro): + per-head QK-norm, KV-shift, per-head output norm, sigmoid output gate, smaller MLP.
* Transformer (LLaMA / Pro): the same blocks with ``fgate_type="none"`` and ``use_rope=True``
  (a forget gate of all ones is plain causal softmax attention).

Attention is chosen by name (``config.attn_backend``) among functions with one signature:
``fot.kernels.forgetting_attention_reference`` (pure PyTorch, any device) and the Triton
``fot.kernels.forgetting_attention``, imported lazily so the model runs on CPU without Triton.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .cache import FoTCache, FoTLayerCache, StaticStep
from .configuration_fot import ATTN_BACKENDS, FGATE_TYPES, FoTConfig, triton_head_dim_problem

logger = logging.get_logger(__name__)

IGNORE_INDEX = -100
# transformers 5.24 renamed the cache argument and output field ``past_key_values`` to
# ``cache`` (the old name still works there, with a deprecation warning). FoT models take
# either name and return the cache under the installed release's field.
CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


def _one_cache(past_key_values: FoTCache | None, cache: FoTCache | None) -> FoTCache | None:
    """The cache passed as ``past_key_values`` (transformers < 5.24) or ``cache`` (>= 5.24)."""
    if past_key_values is not None and cache is not None:
        raise ValueError(
            "the cache was passed twice, as past_key_values and as cache: pass it once (cache= "
            "is transformers' name from 5.24 on, past_key_values= before)"
        )
    return cache if cache is not None else past_key_values


# ---------------------------------------------------------------------------------------
# Attention backends: chosen by name, one signature each for full attention and decode.
# ---------------------------------------------------------------------------------------


def _runs_triton(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` on ``device`` is served by the Triton kernels."""
    return not (backend == "reference" or (backend in ("auto", "sdpa") and device.type != "cuda"))


def get_attention_functions(backend: str, device: torch.device) -> tuple[Callable, Callable]:
    """Return ``(attention, decode_attention)`` for a backend name.

    Args:
        backend: ``"auto"`` (Triton on CUDA tensors, reference elsewhere), ``"triton"``,
            ``"reference"`` or ``"sdpa"`` (the gated paths of ``"sdpa"`` are those of
            ``"auto"``; :func:`sdpa_attention` serves the ungated whole-sequence case, chosen
            in :class:`FoTAttention`).
        device: device of the query tensor (decides ``"auto"`` and ``"sdpa"``).

    Returns:
        Two callables with the signatures of ``fot.kernels.forgetting_attention_reference`` and
        ``fot.kernels.forgetting_attention_decode_reference``.
    """
    if not _runs_triton(backend, device):
        from fot.kernels.reference import (
            forgetting_attention_decode_reference,
            forgetting_attention_reference,
        )

        return forgetting_attention_reference, forgetting_attention_decode_reference
    if backend not in ("auto", "triton", "sdpa"):
        raise ValueError(
            f"unknown attn_backend {backend!r}; valid: ['auto', 'triton', 'reference', 'sdpa']"
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            f"attn_backend='triton' runs the Triton kernels, which need CUDA tensors, but the "
            f"model's inputs are on {device}; move the model to a GPU, or set "
            "config.attn_backend='auto' (Triton on CUDA, PyTorch elsewhere) or 'reference', "
            "e.g. FoTForCausalLM.from_pretrained(path, attn_backend='auto') or `model."
            "config.attn_backend = 'auto'` (TRITON_INTERPRET=1 runs the kernels in Triton's "
            "slow interpreter)"
        )
    try:  # lazily: Triton is only needed on this path
        from fot.kernels import forgetting_attention, forgetting_attention_decode
    except ImportError as err:
        raise ImportError(
            "attn_backend='triton' needs fot.kernels.forgetting_attention and "
            f"forgetting_attention_decode (Triton) but importing them failed: {err}. Use "
            "attn_backend='reference' to run without Triton."
        ) from err
    return forgetting_attention, forgetting_attention_decode


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention without a forget gate, through ``F.scaled_dot_product_attention``.

    Same signature as ``fot.kernels.forgetting_attention_reference``, for the case ``log f = 0``
    (gate ``none``): SDPA picks cuDNN / FlashAttention on CUDA and a fused CPU kernel elsewhere.

    Args:
        q: ``[B, T, HQ, D]``; k, v: ``[B, T, H, D]`` (``HQ % H == 0``: GQA).
        log_fgate: ignored (must be all zeros, i.e. no gate; not checked: no host sync).
        scale: logit scale, default ``D ** -0.5``.
        cu_seqlens, window_size: not supported (must be None); use the kernel for those.

    Returns:
        ``[B, T, HQ, D]`` in the dtype of ``q`` (or the autocast dtype).
    """
    if cu_seqlens is not None or window_size is not None:
        raise ValueError(
            "sdpa_attention supports neither cu_seqlens nor window_size; use the Triton or "
            "reference forgetting attention for packed documents or a sliding window"
        )
    hq, hkv = q.shape[2], k.shape[2]
    if k.shape[2] != v.shape[2] or hq % hkv:
        raise ValueError(
            f"GQA needs HQ % H == 0 and equal K/V heads, got {hq}, {hkv}, {v.shape[2]}"
        )
    extra = {"enable_gqa": True} if hq != hkv else {}  # only when needed: keeps every backend
    # Eager only: under torch.compile the backend is left to PyTorch (and Inductor).
    prefer = q.is_cuda and not torch.compiler.is_compiling()
    with _sdpa_priority() if prefer else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # (B, HQ, T, D): the layout SDPA wants (a view, no copy)
            k.transpose(1, 2),  # (B, H, T, D)
            v.transpose(1, 2),
            is_causal=True,
            scale=scale,
            **extra,
        )  # (B, HQ, T, D)
    return o.transpose(1, 2)  # (B, T, HQ, D)


def _sdpa_priority() -> contextlib.AbstractContextManager:
    """Try cuDNN attention first on CUDA, then FlashAttention-2, then the others.

    Measured on one H200 (bf16, causal, T=16k, 12 heads of dim 128, fwd+bwd): cuDNN 537 TFLOP/s,
    FlashAttention-2 316 (DESIGN.md §5). Inputs cuDNN does not support fall through to the next.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    return sdpa_kernel(order, set_priority=True)


@torch.compiler.disable
def _run_kernel(fn: Callable, *args, **kwargs) -> torch.Tensor:
    """Call an attention function outside torch.compile's graph (a deliberate graph break).

    The Triton kernels are an autograd.Function with autotuned launchers that Dynamo need not
    trace; under per-block compile the code before and after the call is compiled, the kernel
    runs as is.
    """
    return fn(*args, **kwargs)


def hooked(module: nn.Module, device: torch.device | None = None) -> bool:
    """Whether ``module`` carries forward or backward hooks of its own (which only calling
    it runs: the fused paths that read its weights skip them).

    accelerate's hooks (``from_pretrained(device_map=...)``) replace ``module.forward``
    instead of registering a hook. With offloading (``"cpu"`` / ``"disk"`` entries in a device
    map that has a GPU) the module's weights are on the meta device except while the module
    is called: hooked. Without offloading, a hook only moves the module's inputs to its
    device, so it does not count where the caller's input is on ``device`` and so are all of
    the module's parameters (a model split over GPUs by layers keeps its fused kernels).

    Args:
        module: the module whose weights a fused path would read.
        device: where the caller's input is (None: every accelerate hook counts).
    """
    if (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    ):
        return True
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return False
    # accelerate.hooks.AlignDevicesHook without offloading (accelerate is not imported here)
    moves_inputs_only = (
        type(hook).__name__ == "AlignDevicesHook"
        and not hook.offload
        and getattr(hook, "weights_map", None) is None
    )
    return not (
        moves_inputs_only
        and device is not None
        and all(t.device == device for t in itertools.chain(module.parameters(), module.buffers()))
    )


def plain_linear(layer: nn.Module, device: torch.device | None = None) -> bool:
    """Whether a fused path may read ``layer.weight`` instead of calling ``layer``.

    True for an ``nn.Linear`` (or the forget gate's subclass) without module hooks (see
    :func:`hooked`; ``device`` is where the caller's input is). A wrapper (PEFT/LoRA adapters,
    a quantised or otherwise subclassed linear) or a hook changes what calling the module
    computes, so those layers always run as modules: the fused GEMMs, the forget gate's logits
    in the fused norm and the fused loss are skipped for them (slower, never wrong). Norms
    with hooks likewise leave their fused kernels.
    """
    return type(layer) in (nn.Linear, FoTForgetGateProj) and not hooked(layer, device)


def _fusable(layer: nn.Module, device: torch.device | None = None) -> bool:
    """A :func:`plain_linear` without bias: its weight can join a concatenated GEMM."""
    return plain_linear(layer, device) and layer.bias is None


def fused_linear(x: torch.Tensor, layers: list[nn.Module], *, mixed: bool = False) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)`` for bias-free linear layers, one GEMM.

    The weights are concatenated (in the autocast dtype when autocast is on) and multiplied
    once: under autocast the input is cast to 16 bits once instead of once per layer, and the
    backward computes one input gradient instead of one per layer summed in float32. Layers
    that are not :func:`plain_linear` (adapters, hooks) or have a bias are called one by one.
    With ``mixed=True``, a few rows without autograd or autocast (a decode step on CUDA) go
    through :func:`fot.kernels.linear_ops.few_rows_linear` (no concatenated weights).

    With ``mixed=True`` (the eager kernel path), under autocast and with float32 weights of
    plain ``nn.Linear`` layers, :func:`fot.kernels.linear_ops.mixed_precision_linear` does the
    same GEMM with one cast launch for all weights and float32 weight gradients straight from
    the backward GEMM (no 16-bit weight gradient, no cast kernels).

    Args:
        x: ``[..., in_features]``.
        layers: bias-free linear layers with that ``in_features``.
        mixed: allow the mixed-precision and few-row kernels (callers pass it outside
            ``torch.compile``).

    Returns:
        ``[..., sum of out_features]``, the layers' outputs side by side in ``layers`` order.
    """
    if not all(_fusable(layer, x.device) for layer in layers):
        return torch.cat([layer(x) for layer in layers], -1) if len(layers) > 1 else layers[0](x)
    dtype = _autocast_dtype(x)
    if (
        mixed
        and dtype in (torch.float16, torch.bfloat16)
        and all(layer.weight.dtype == torch.float32 for layer in layers)
    ):
        from fot.kernels.linear_ops import mixed_precision_linear

        return mixed_precision_linear(x, [layer.weight for layer in layers], dtype)
    if len(layers) == 1:
        return layers[0](x)
    if mixed and dtype is None:
        # A few rows, no autograd (a decode step): one launch reads each weight once instead
        # of concatenating them all first (3x the bytes of a GEMM bound by its weights).
        from fot.kernels.linear_ops import few_rows_linear, few_rows_linear_supported

        weights = [layer.weight for layer in layers]
        if few_rows_linear_supported(x, weights):
            return few_rows_linear(x, weights)
    weight = torch.cat(
        [layer.weight if dtype is None else layer.weight.to(dtype) for layer in layers]
    )
    return F.linear(x, weight)


def fused_projections(
    x: torch.Tensor, layers: list[nn.Module], *, mixed: bool = False
) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]`` as one GEMM (:func:`fused_linear`), split into views.

    Args:
        x: ``[..., in_features]``.
        layers: bias-free linear layers with that ``in_features``.
        mixed: as in :func:`fused_linear`.

    Returns:
        One ``[..., out_features]`` tensor per layer: column slices (views) of one output.
    """
    if not all(_fusable(layer, x.device) for layer in layers):
        return [layer(x) for layer in layers]
    y = fused_linear(x, layers, mixed=mixed)
    return [y] if len(layers) == 1 else list(y.split([lay.out_features for lay in layers], -1))


# ---------------------------------------------------------------------------------------
# Small layers
# ---------------------------------------------------------------------------------------


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or as it is when it is float64 (a float64 model keeps its precision)."""
    return t if t.dtype == torch.float64 else t.float()


def _rms_normalize(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x / rms(x) [* weight]`` over the last dim, fp32 math inside, ``x``'s dtype out.

    One ``F.rms_norm`` call (a fused kernel on CUDA that saves only ``x`` and the per-row rstd
    for backward) instead of a chain of fp32 ops that each keep an fp32 copy of ``x``. Autocast
    is off inside: the norm must not upcast its input and return fp32.
    """
    with torch.autocast(x.device.type, enabled=False):
        w = weight.to(x.dtype) if weight is not None else None
        return F.rms_norm(x, (x.shape[-1],), w, eps)


class FoTRMSNorm(nn.Module):
    """RMSNorm over the last dim (fp32 math): ``x / rms(x) * weight``, ``x``'s dtype out."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` normalised over its last axis and scaled, in x's dtype."""
        # The weight is cast to x's dtype (not x to fp32): under bf16 autocast an fp32 weight
        # times a bf16 tensor would promote q/k to fp32 while v stays bf16.
        return _rms_normalize(x, self.eps, self.weight)

    def add_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        fused: bool,
        out_dtype: torch.dtype | None = None,
        proj: nn.Linear | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The pre-norm step of a block: ``h = residual + x`` and ``norm(h)``.

        Args:
            x: ``[B, T, hidden]``, the previous block's output (or the embeddings, with
                ``residual=None``: then ``h = x``).
            residual: ``[B, T, hidden]``, the stream before that block, or None.
            fused: one kernel each way (``fot.kernels.add_rms_norm``); otherwise PyTorch ops.
                Both compute the same function.
            out_dtype: dtype of the normalised output (e.g. the autocast dtype, so that the
                next GEMM needs no cast); default ``h``'s.
            proj: a narrow linear layer (the forget gate's) applied in float32 to the
                unrounded ``norm(h)``; needs a float32 stream. Called as a module when it is
                not :func:`plain_linear` (an adapter, hooks).

        Returns:
            ``(norm(h) [B, T, hidden] in out_dtype, h [B, T, hidden])``, and with ``proj``
            also ``proj(norm(h))`` ``[B, T, out_features]`` float32.
        """
        if proj is not None and not plain_linear(proj, x.device):
            y, h = self.add_norm(x, residual, fused)  # (B, T, hidden) float32
            with torch.autocast(h.device.type, enabled=False):
                z = proj(y).float()  # (B, T, out_features)
            return (y if out_dtype is None else y.to(out_dtype)), h, z
        pw, pb = (proj.weight, proj.bias) if proj is not None else (None, None)
        if fused and not hooked(self, x.device):
            from fot.kernels.norm_ops import add_rms_norm

            return add_rms_norm(
                x, residual, self.weight, eps=self.eps, out_dtype=out_dtype,
                proj_weight=pw, proj_bias=pb,
            )  # fmt: skip
        h = x if residual is None else residual + x
        y = self(h)
        out = (y if out_dtype is None else y.to(out_dtype)), h
        if proj is None:
            return out
        with torch.autocast(h.device.type, enabled=False):
            z = F.linear(y.float(), pw.float(), pb.float() if pb is not None else None)
        return (*out, z)


class FoTHeadRMSNorm(nn.Module):
    """Per-head RMSNorm with per-head weights: ``[..., H, D]`` normalised over ``D``.

    Used for QK-norm and the output norm of FoT (Pro); weight ``[H, D]`` (one scale vector per
    head, not shared across heads).
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., H, D]`` -> same shape and dtype; times ``gate`` (same shape) if given.

        The per-head weight ``[H, D]`` is not one vector over ``D``, so it is applied after the
        normalisation, in ``x``'s dtype (bf16 under autocast: no fp32 ``[B, T, H, D]`` copy).
        """
        y = _rms_normalize(x, self.eps)  # (..., H, D)
        w = self.weight.to(y.dtype)
        if gate is not None:  # output gate folded in: (y * w) * gate, one fewer saved tensor
            return y * (w * gate.to(y.dtype))
        return y * w


class FoTMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: FoTConfig) -> None:
        super().__init__()
        self.config = config
        width = config.mlp_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU MLP: ``x [..., hidden_size] -> [..., hidden_size]``."""
        projections = [self.gate_proj, self.up_proj]
        # Eager on the kernel backends: one fused kernel each way (fot.kernels.swiglu).
        if _use_fused_eager(self.config.attn_backend, x):
            from fot.kernels.mlp_ops import swiglu

            h = swiglu(fused_linear(x, projections, mixed=True))  # (B, T, mlp_size)
            return fused_linear(h, [self.down_proj], mixed=True)  # (B, T, hidden)
        gate, up = fused_projections(x, projections)
        return self.down_proj(F.silu(gate) * up)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (LLaMA's RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for ``positions`` ``[B, T]``: ``cos, sin`` ``[B, T, 1, head_dim]`` float32.

    Computed once per forward (fp32: positions up to 64k and beyond stay exact).
    """
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (D/2,)
    angles = positions.float()[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # (B, T, 1, D)
    return emb.cos(), emb.sin()


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[B, T, HQ, D]`` and k ``[B, T, H, D]`` (LLaMA layout) in fp32; input dtype out."""
    return _RoPE.apply(q, cos, sin), _RoPE.apply(k, cos, sin)


class _RoPE(torch.autograd.Function):
    """``y = x cos + rotate_half(x) sin`` in fp32, ``x``'s dtype out.

    Why a Function: RoPE is linear in ``x``, so backward needs only ``cos``/``sin`` (shared by
    all layers), not the fp32 copies of ``[B, T, H, D]`` tensors that autograd would keep.
    ``rotate_half`` is a rotation by 90 degrees, whose transpose is ``-rotate_half``, so
    ``dx = g cos - rotate_half(g sin)``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 stays fp64)
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        g = grad.to(torch.promote_types(grad.dtype, torch.float32))
        return (g * cos - rotate_half(g * sin)).to(grad.dtype), None, None


def long_init_bias(num_heads: int, t_min: float, t_max: float) -> torch.Tensor:
    """Forget-gate biases whose decay times ``1 / (-log sigmoid(b))`` are log-uniform in
    ``[t_min, t_max]`` across heads ("long-init", paper App. B).

    Returns:
        ``[num_heads]`` float32.
    """
    decay_time = torch.exp(
        torch.linspace(math.log(t_min), math.log(t_max), num_heads, dtype=torch.float64)
    )
    # -log sigmoid(b) = x = 1/T  <=>  sigmoid(b) = exp(-x)  <=>  b = -x - log(1 - exp(-x)),
    # written with expm1(-x), which never overflows (-log(expm1(x)) is -inf for T < 1.41e-3)
    x = 1.0 / decay_time
    return (-x - torch.log(-torch.expm1(-x))).float()


def token_shift(
    x: torch.Tensor,
    shift_logits: torch.Tensor,
    prev: torch.Tensor | None,
    reset: torch.Tensor | None,
) -> torch.Tensor:
    """Data-dependent token shift ``y_t = a_t * x_{t-1} + (1 - a_t) * x_t``, ``a = sigmoid``.

    Args:
        x: ``[B, T, H, D]`` pre-shift projections (padding already holds the previous real
            token's value, see ``_fill_padding``).
        shift_logits: ``[B, T, H]`` logits of ``a_t`` (one mixing weight per head and step).
        prev: ``[B, H, D]`` the projection of the token before ``x[:, 0]`` (cache), or None
            (sequence start: ``x_{-1} = 0``).
        reset: ``[T]`` bool, True where a new document starts (``x_{t-1}`` treated as 0).

    Returns:
        ``[B, T, H, D]`` in x's dtype.
    """
    first = torch.zeros_like(x[:, :1]) if prev is None else prev[:, None].to(x.dtype)
    x_prev = torch.cat([first, x[:, :-1]], dim=1)  # (B, T, H, D)
    if reset is not None:
        x_prev = x_prev.masked_fill(reset[None, :, None, None], 0.0)
    # One fused op in x's dtype (lerp computes in fp32 internally for bf16): x + a (x_prev - x).
    # Only x, x_prev and a are saved for backward, not fp32 copies of [B, T, H, D] tensors.
    a = torch.sigmoid(at_least_fp32(shift_logits)).to(x.dtype)[..., None]  # (B, T, H, 1)
    return torch.lerp(x, x_prev, a)


def _fill_padding(x: torch.Tensor, real: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """Give every padding position the value of the last real position before it.

    Args:
        x: ``[B, T, H, D]`` pre-shift projections.
        real: ``[B, T]`` bool, True for tokens, False for padding (anywhere in the row).
        prev: ``[B, H, D]`` the value before ``x[:, 0]`` (the cache's last pre-shift
            projection), or None (zero: nothing came before).

    Returns:
        ``[B, T, H, D]`` in x's dtype: ``x`` at real positions; at padding, the last real
        position's value, else ``prev`` (or zero) when no real token precedes it in ``x``.
    """
    B, T = real.shape
    first = torch.zeros_like(x[:, :1]) if prev is None else prev[:, None].to(x.dtype)
    ext = torch.cat([first, x], dim=1)  # (B, T + 1, H, D): index 0 is what came before
    pos = torch.arange(1, T + 1, device=x.device).expand(B, T)
    src = torch.where(real.to(x.device), pos, 0).cummax(dim=1).values  # (B, T) last real index
    idx = src[:, :, None, None].expand(-1, -1, *x.shape[2:])
    return ext.gather(1, idx)


def _shift_then_norm(
    x: torch.Tensor,
    shift_logits: torch.Tensor,
    prev: torch.Tensor | None,
    reset: torch.Tensor | None,
    norm: nn.Module | None,
) -> torch.Tensor:
    """KV-shift, then the (optional) per-head RMSNorm: ``[B, T, H, D]`` in, same out."""
    y = token_shift(x, shift_logits, prev, reset)
    return norm(y) if norm is not None else y


def _norm_then_gate(
    o: torch.Tensor, gate_logits: torch.Tensor | None, norm: nn.Module | None
) -> torch.Tensor:
    """Output norm (optional) and sigmoid output gate (optional) of ``o`` ``[B, T, HQ, D]``."""
    gate = torch.sigmoid(gate_logits) if gate_logits is not None else None
    if norm is not None:
        return norm(o, gate)  # norm and gate in one expression
    return o * gate.to(o.dtype)


def _recomputed(enabled: bool, fn: Callable, *args) -> torch.Tensor:
    """``fn(*args)``; if ``enabled`` and under autograd, keep only the inputs and recompute
    ``fn`` in backward (``FoTConfig.recompute_pro``).

    For the Pro components (KV-shift, QK-norm, output norm and gate): elementwise work of a few
    bytes per element, while keeping their intermediates costs ~21 KB per token per layer at
    760m (~8 GiB at T=16k, 24 layers). Non-reentrant checkpoint: nests inside block-level
    activation checkpointing and traces under torch.compile.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if enabled and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _use_fused_kernels(backend: str, t: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels (``fot.kernels.pro_ops``, ``fot.kernels.swiglu``) run.

    Follows the attention backend's name: ``"reference"`` keeps the PyTorch composition,
    ``"triton"`` always uses the fused functions (which fall back to the same math in PyTorch on
    CPU without ``TRITON_INTERPRET=1``), ``"auto"``/``"sdpa"`` use them on CUDA. Only for the
    dtypes the kernels take (16/32-bit floats).
    """
    if backend == "reference" or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return backend == "triton" or t.device.type == "cuda"


def _use_fused_eager(backend: str, t: torch.Tensor) -> bool:
    """:func:`_use_fused_kernels` outside ``torch.compile`` (SwiGLU, add + norm): compiled,
    the PyTorch form is left to Inductor, which fuses it without a graph break."""
    return _use_fused_kernels(backend, t) and not torch.compiler.is_compiling()


def _autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype on ``t``'s device, or None when autocast is off there."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def _use_fused_pro(backend: str, t: torch.Tensor, head_dim: int) -> bool:
    """:func:`_use_fused_kernels` for the Pro components, whose kernels take ``head_dim <= 256``."""
    # 256 = fot.kernels.pro_ops.MAX_HEAD_DIM (not imported: Triton is loaded lazily)
    return head_dim <= 256 and _use_fused_kernels(backend, t)


@dataclass
class _Context:
    """Per-forward information shared by all layers (built once in :class:`FoTModel`)."""

    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin (B, T, 1, D); None = no RoPE
    cu_seqlens: torch.Tensor | None  # (N + 1,) packed documents (B == 1)
    doc_starts: torch.Tensor | None  # (T,) bool, True at document starts (KV-shift reset)
    key_mask: torch.Tensor | None  # (B, Tk) bool over cached + new keys; None = all valid
    query_mask: torch.Tensor | None  # (B, T) bool over the new positions; None = all valid
    # A static decode step (FoTCache.static_step): the sliding window is part of key_mask,
    # whose length is the step's bucket, not the number of cached keys.
    window_in_key_mask: bool = False

    def to(self, device: torch.device | str | int, non_blocking: bool = False) -> _Context:
        """A copy with every tensor on ``device``.

        accelerate's hooks call this (through ``send_to_device``) when
        ``from_pretrained(device_map=...)`` puts layers on different GPUs: each layer then gets
        the RoPE tables, masks and document boundaries on its own device.
        """

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        rope = None if self.rope is None else (move(self.rope[0]), move(self.rope[1]))
        return replace(
            self,
            rope=rope,
            cu_seqlens=move(self.cu_seqlens),
            doc_starts=move(self.doc_starts),
            key_mask=move(self.key_mask),
            query_mask=move(self.query_mask),
        )


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------


def _keep_fp32(fn: Callable) -> Callable:
    """``fn`` (a tensor conversion ``nn.Module._apply`` maps over a module's tensors) with
    float32 tensors kept float32 where it would make them 16-bit; device moves and other casts
    (float64) apply as usual."""

    def keep_fp32(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if t.dtype == torch.float32 and out.dtype in (torch.float16, torch.bfloat16):
            return t.to(device=out.device)
        return out

    return keep_fp32


class FoTForgetGateProj(nn.Linear):
    """The data-dependent forget gate's projection ``hidden -> HQ`` logits (a plain
    ``nn.Linear``; its own class so that ``_init_weights`` gives its bias
    ``config.fgate_bias_init`` instead of 0).

    Its float32 weights stay float32 when the model is cast to 16 bits (``model.to(torch.
    bfloat16)``, ``.half()``), as ``from_pretrained(dtype=...)`` keeps them
    (``_keep_in_fp32_modules_strict``): in bf16 a bias of 6.3 becomes 6.3125, which moves
    ``log f`` by 2e-5 per token, 0.36 nats of decay over 16k tokens. Other casts (float64)
    and device moves apply as usual.
    """

    def _apply(self, fn: Callable, recurse: bool = True) -> FoTForgetGateProj:
        return super()._apply(_keep_fp32(fn), recurse)


class FoTAttention(nn.Module):
    """Forgetting attention with optional Pro components, RoPE and sliding window."""

    def __init__(self, config: FoTConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.fgate_type = config.fgate_type
        hidden, hq, hkv, d = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim

        self.q_proj = nn.Linear(hidden, hq * d, bias=False)
        self.k_proj = nn.Linear(hidden, hkv * d, bias=False)
        self.v_proj = nn.Linear(hidden, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, hidden, bias=False)

        # Forget gate: one scalar per query head and time step.
        if self.fgate_type == "full":
            self.fgate_proj = FoTForgetGateProj(hidden, hq, bias=True)
        elif self.fgate_type == "bias_only":
            self.fgate_bias = nn.Parameter(
                long_init_bias(hq, config.decay_time_min, config.decay_time_max)
            )
        elif self.fgate_type == "fixed":
            # A buffer, not a Parameter: never trained (ALiBi-like fixed linear decay per head).
            self.register_buffer(
                "fgate_bias", long_init_bias(hq, config.decay_time_min, config.decay_time_max)
            )
        elif self.fgate_type != "none":
            raise ValueError(f"unknown fgate_type {self.fgate_type!r}; valid: {list(FGATE_TYPES)}")

        if config.use_k_shift:
            self.k_shift_proj = nn.Linear(hidden, hkv, bias=False)
        if config.use_v_shift:
            self.v_shift_proj = nn.Linear(hidden, hkv, bias=False)
        if config.qk_norm:
            self.q_norm = FoTHeadRMSNorm(hq, d, config.qk_norm_eps)
            self.k_norm = FoTHeadRMSNorm(hkv, d, config.qk_norm_eps)
        if config.use_output_norm:
            self.o_norm = FoTHeadRMSNorm(hq, d, config.norm_eps)
        if config.use_output_gate:
            self.g_proj = nn.Linear(hidden, hq * d, bias=False)

    def _apply(self, fn: Callable, recurse: bool = True) -> FoTAttention:
        """``nn.Module._apply`` (``.to``, ``.half()``, device moves) with the data-independent
        gate's ``fgate_bias`` kept float32 under 16-bit casts, as :class:`FoTForgetGateProj`
        keeps the full gate's: bf16 rounds the long-init bias 9.704 (decay time 16k) to
        9.6875, 1.7% off in ``log f``, and moves a fast head's decay over 16k tokens by up to
        5 nats. The projections (children) are cast as usual; ``fgate_bias`` is this module's
        only own tensor."""
        if recurse:
            for module in self.children():
                module._apply(fn)
        return super()._apply(_keep_fp32(fn), recurse=False)

    def log_fgate(self, x: torch.Tensor) -> torch.Tensor:
        """Log forget gate ``[B, T, HQ]`` float32 for hidden states ``x`` ``[B, T, hidden]``."""
        B, T, _ = x.shape
        if self.fgate_type == "full":
            # The gate logits are computed in fp32 (tiny: HQ outputs), never in bf16, also
            # under autocast (which would otherwise run this matmul in bf16).
            # (float64 in a float64 model)
            proj = self.fgate_proj
            if self.few_rows_gate(x):
                from fot.kernels.linear_ops import few_rows_logsigmoid_linear

                return few_rows_logsigmoid_linear(x, proj.weight, proj.bias)
            dtype = torch.promote_types(x.dtype, torch.float32)
            with torch.autocast(x.device.type, enabled=False):
                if plain_linear(proj, x.device):
                    logits = F.linear(x.to(dtype), proj.weight.to(dtype), proj.bias.to(dtype))
                else:  # an adapter or hooks: the module, in its weights' dtype
                    logits = at_least_fp32(proj(x.to(proj.weight.dtype)))  # (B, T, HQ)
            return F.logsigmoid(logits)
        if self.fgate_type in ("bias_only", "fixed"):
            return F.logsigmoid(at_least_fp32(self.fgate_bias)).expand(B, T, self.num_heads)
        dtype = torch.promote_types(x.dtype, torch.float32)
        return x.new_zeros(B, T, self.num_heads, dtype=dtype)  # "none": f = 1

    def few_rows_gate(self, x: torch.Tensor) -> bool:
        """Whether :meth:`log_fgate` of ``x`` ``[B, T, hidden]`` runs in one launch
        (:func:`fot.kernels.linear_ops.few_rows_logsigmoid_linear`): a decode step (a few rows,
        no autograd) on the kernel path, where PyTorch spends a cast, a GEMV, its reduction and
        the log-sigmoid."""
        proj = getattr(self, "fgate_proj", None)
        if proj is None or not _use_fused_eager(self.config.attn_backend, x):
            return False
        if not plain_linear(proj, x.device):
            return False
        from fot.kernels.linear_ops import few_rows_logsigmoid_linear_supported

        return few_rows_logsigmoid_linear_supported(x, proj.weight, proj.bias)

    def _use_sdpa(
        self,
        backend: str,
        device: torch.device,
        cu_seqlens: torch.Tensor | None,
        window: int | None,
    ) -> bool:
        """Whether whole-sequence attention runs through ``F.scaled_dot_product_attention``.

        Only without a forget gate (``log f = 0``: plain causal softmax), without packed
        documents and without a window; then for ``"sdpa"`` on any device and for ``"auto"`` on
        CUDA (cuDNN/FlashAttention beat our kernel, which cannot prune anything at ``f = 1``).
        """
        if self.fgate_type != "none" or cu_seqlens is not None or window is not None:
            return False
        return backend == "sdpa" or (backend == "auto" and device.type == "cuda")

    def forward(
        self,
        x: torch.Tensor,
        ctx: _Context,
        cache: FoTLayerCache | None = None,
        gate_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the normalised hidden states ``x`` ``[B, T, hidden]``.

        ``gate_logits`` ``[B, T, HQ]`` float32: the forget gate's logits when the caller has
        them already (the fused add + norm kernel computes them from the unrounded norm
        output); otherwise they come from ``x`` (:meth:`log_fgate`).
        """
        B, T, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cfg = self.config
        # Every bias-free projection of x in one GEMM (the gate's fp32 projection stays apart).
        layers = [self.q_proj, self.k_proj, self.v_proj]
        layers += [self.g_proj] if cfg.use_output_gate else []
        layers += [self.k_shift_proj] if cfg.use_k_shift else []
        layers += [self.v_shift_proj] if cfg.use_v_shift else []
        mixed = _use_fused_eager(cfg.attn_backend, x)
        # On the kernel backends: one fused kernel per component in forward and in backward,
        # saving only its inputs (recompute_pro does not apply); with a cache, the KV-shift
        # continues from the cached last k/v.
        norms = [getattr(self, n, None) for n in ("q_norm", "k_norm", "o_norm")]
        fused = _use_fused_pro(cfg.attn_backend, x, d) and not any(
            hooked(n, x.device) for n in norms if n is not None
        )
        grads = None  # with the fused kernels: their input gradients go into one buffer
        if fused and mixed and len(layers) > 1 and all(_fusable(lay, x.device) for lay in layers):
            from fot.kernels.pro_ops import split_columns

            y = fused_linear(x, layers, mixed=True)  # (B, T, sum of widths)
            parts, grads = split_columns(y, [layer.out_features for layer in layers])
            outs = iter(parts)
        else:
            outs = iter(fused_projections(x, layers, mixed=mixed))
        q = next(outs).view(B, T, hq, d)  # (B, T, HQ, D)
        k = next(outs).view(B, T, hkv, d)  # (B, T, H, D)
        v = next(outs).view(B, T, hkv, d)  # (B, T, H, D)
        g = next(outs).view(B, T, hq, d) if cfg.use_output_gate else None  # (B, T, HQ, D)
        k_shift = next(outs) if cfg.use_k_shift else None  # (B, T, H) logits
        v_shift = next(outs) if cfg.use_v_shift else None  # (B, T, H) logits
        if ctx.query_mask is not None:
            # Padding is removed from the sequence: the KV-shift of a real token mixes in the
            # previous *real* token (across left padding and gaps alike), so each padding
            # position carries the last real token's k/v (or the cache's, or zero).
            if cfg.use_k_shift:
                k = _fill_padding(k, ctx.query_mask, cache.k_shift if cache is not None else None)
            if cfg.use_v_shift:
                v = _fill_padding(v, ctx.query_mask, cache.v_shift if cache is not None else None)

        if gate_logits is not None:
            log_f = F.logsigmoid(gate_logits)  # (B, T, HQ) float32
        else:
            log_f = self.log_fgate(x)  # (B, T, HQ) float32
        if ctx.query_mask is not None:
            log_f = log_f * ctx.query_mask[:, :, None]

        backend = self.config.attn_backend
        attn, decode = get_attention_functions(backend, q.device)
        scale, window = d**-0.5, self.config.window_size
        past = cache.seq_length if cache is not None else 0
        whole = past == 0 and ctx.key_mask is None
        use_sdpa = whole and self._use_sdpa(backend, q.device, ctx.cu_seqlens, window)
        if (
            not use_sdpa
            and _runs_triton(backend, q.device)
            and (problem := triton_head_dim_problem(self.config, d))
        ):
            raise ValueError(problem)  # (the kernel's own error named a kernel function)

        # KV-shift mixes each token's k/v with the previous token's (pre-shift) k/v.
        k_pre, v_pre = k, v
        k_norm = self.k_norm if self.config.qk_norm else None
        recompute = self.config.recompute_pro
        step = None  # a static decode step: shift, norms and cache write in one launch
        if fused and mixed and cache is not None and not cfg.use_rope and ctx.doc_starts is None:
            step = cache.append_step(
                q, k, v, log_f,
                k_logits=k_shift, v_logits=v_shift,
                k_norm=(k_norm.weight, k_norm.eps) if k_norm is not None else None,
                q_norm=(self.q_norm.weight, self.q_norm.eps) if cfg.qk_norm else None,
            )  # fmt: skip
        if step is not None:
            q, c_q = step
        elif fused:
            from fot.kernels.pro_ops import shift_norm

            if cfg.use_k_shift or k_norm is not None:  # shift + norm, shift only or norm only
                k = _run_kernel(
                    shift_norm,
                    k_pre,
                    k_shift,  # (B, T, H) or None
                    k_norm.weight if k_norm is not None else None,  # (H, D)
                    eps=k_norm.eps if k_norm is not None else 1e-6,
                    reset=ctx.doc_starts,
                    grads=grads,
                    prev=cache.k_shift if cache is not None else None,  # (B, H, D) or None
                )  # (B, T, H, D)
            if cfg.use_v_shift:
                v = _run_kernel(
                    shift_norm,
                    v_pre,
                    v_shift,
                    reset=ctx.doc_starts,
                    grads=grads,
                    prev=cache.v_shift if cache is not None else None,
                )
            if cfg.qk_norm:
                q = _run_kernel(
                    shift_norm, q, None, self.q_norm.weight, eps=self.q_norm.eps, grads=grads
                )
        else:
            # PyTorch path. Shift and norm are cheap elementwise ops on [B, T, H, D] tensors:
            # under autograd they run inside `_recomputed` (only their inputs are kept; backward
            # recomputes them).
            if self.config.use_k_shift:  # k_t = RMSNorm(shifted k): both in one region
                prev = cache.k_shift if cache is not None else None
                k = _recomputed(
                    recompute,
                    _shift_then_norm,
                    k_pre,
                    k_shift,
                    prev,
                    ctx.doc_starts,
                    k_norm,
                )
            elif k_norm is not None:
                k = _recomputed(recompute, k_norm, k)
            if self.config.use_v_shift:
                prev = cache.v_shift if cache is not None else None
                v = _recomputed(recompute, token_shift, v_pre, v_shift, prev, ctx.doc_starts)
            if self.config.qk_norm:
                q = _recomputed(recompute, self.q_norm, q)
        if self.config.use_rope:
            q, k = apply_rope(q, k, *ctx.rope)

        if cache is not None and step is None:
            c_q = cache.append(
                k,
                v,
                log_f,
                k_pre if self.config.use_k_shift else None,
                v_pre if self.config.use_v_shift else None,
                fused=mixed,
            )  # (B, T, HQ)
        o_norm = self.o_norm if self.config.use_output_norm else None
        if whole:
            # Whole sequences (training, evaluation, first prefill): the flash-style kernel, or
            # PyTorch SDPA when there is no gate to apply (Transformer baselines).
            if use_sdpa:
                o = sdpa_attention(q, k, v, log_f, scale=scale)
            else:
                o = _run_kernel(
                    attn, q, k, v, log_f, scale=scale, cu_seqlens=ctx.cu_seqlens, window_size=window
                )
        else:
            # Cached keys or padding: the decode function takes the running gate cumsum c of
            # the queries and of all keys, and a key mask.
            if cache is None:
                c_q = torch.cumsum(log_f.double(), dim=1)  # float64: long rows' |c| is large
                keys, values, c_k = k, v, c_q
            else:
                keys, values, c_k = cache.keys, cache.values, cache.cumsum
            if step is not None and (o_norm is not None or g is not None):
                # a static step (fused kernels): the output norm and gate in the merge kernel
                w, eps = (o_norm.weight, o_norm.eps) if o_norm is not None else (None, 1e-6)
                out_parts = {"gate": g, "norm_weight": w, "norm_eps": eps}
                o_norm = g = None  # applied: nothing left for the norm and gate below
            else:
                out_parts = {}
            o = _run_kernel(
                decode,
                q,
                keys,
                values,
                c_q,
                c_k,
                scale=scale,
                window_size=None if ctx.window_in_key_mask else window,
                key_mask=ctx.key_mask,
                **out_parts,
            )  # (B, T, HQ, D)

        # o: (B, T, HQ, D)
        if (o_norm is not None or g is not None) and fused:
            from fot.kernels.pro_ops import norm_gate

            w, eps = (o_norm.weight, o_norm.eps) if o_norm is not None else (None, 1e-6)
            o = _run_kernel(norm_gate, o, g, w, eps=eps, grads=grads)  # (B, T, HQ, D)
        elif o_norm is not None or g is not None:
            o = _recomputed(
                self.config.recompute_pro, _norm_then_gate, o, g, o_norm
            )  # (B, T, HQ, D)
        return fused_linear(o.reshape(B, T, hq * d), [self.o_proj], mixed=mixed)  # (B, T, hidden)


class FoTDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    The residual stream travels as ``(branch, residual)`` with ``x = residual + branch``: each
    residual add is done by the norm that follows it, so that on the kernel backends add, norm
    and the cast for the next GEMM are one kernel (``fot.kernels.add_rms_norm``).
    """

    def __init__(self, config: FoTConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = FoTRMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = FoTAttention(config, layer_idx)
        self.post_attention_layernorm = FoTRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = FoTMLP(config)

    def __call__(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Without gradients, the block runs as is, its cache included: there is no backward to
        replay it. (transformers' checkpointing layer before 5.24 dropped the cache whenever
        checkpointing was on in training mode, so generating from such a model continued from
        an empty cache.)"""
        if not torch.is_grad_enabled():
            return nn.Module.__call__(self, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: _Context,
        past_key_values: FoTCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the stream ``residual + hidden_states``.

        Args:
            hidden_states: ``[B, T, hidden]``, the previous block's MLP output (the embeddings
                for the first block, with ``residual=None``).
            residual: ``[B, T, hidden]``, the stream before that output, or None.

        Returns:
            ``(mlp_out, residual)``: the stream after this block is their sum.
        """
        cache = past_key_values[self.self_attn.layer_idx] if past_key_values is not None else None
        fused = _use_fused_eager(self.config.attn_backend, hidden_states)
        gemm_dtype = _autocast_dtype(hidden_states)
        stream = residual if residual is not None else hidden_states
        gate_logits = None
        if self.self_attn.fgate_type != "full":
            x, h = self.input_layernorm.add_norm(hidden_states, residual, fused, gemm_dtype)
        elif stream.dtype == torch.float32 and (
            gemm_dtype is not None or not self.self_attn.few_rows_gate(stream)
        ):
            # The forget gate's fp32 logits come with the norm (on the kernel path out of the
            # fused kernel), from the unrounded norm output; the output itself leaves in the
            # GEMMs' dtype. (A decode step without autocast takes the float32 norm output to
            # log_fgate's one-launch gate instead.)
            x, h, gate_logits = self.input_layernorm.add_norm(
                hidden_states, residual, fused, gemm_dtype, proj=self.self_attn.fgate_proj
            )
        else:
            # A 16-bit stream (a bf16 model): the gate's fp32 projection reads the norm output
            # in that dtype (log_fgate); so does a float32 decode step without autocast.
            x, h = self.input_layernorm.add_norm(hidden_states, residual, fused)
        attn_out = self.self_attn(x, ctx, cache, gate_logits=gate_logits)
        x, h = self.post_attention_layernorm.add_norm(attn_out, h, fused, gemm_dtype)
        return self.mlp(x), h


# ---------------------------------------------------------------------------------------
# HF model classes
# ---------------------------------------------------------------------------------------


def _on_one_device(model: nn.Module) -> bool:
    """Whether every module runs on one device with its own weights: False for a
    ``from_pretrained(device_map=...)`` that spreads the layers over GPUs or offloads some to
    ``"cpu"``/``"disk"`` (their weights are copied in during each call), which a CUDA graph
    cannot capture."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return True
    places = set()
    for d in device_map.values():  # an int is an accelerator index, as in accelerate
        if d == "disk":
            places.add(("disk", 0))
            continue
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        places.add((dev.type, dev.index or 0))
    return len(places) == 1 and next(iter(places))[0] not in ("cpu", "disk", "meta")


def refuse_hf_attention(attn_implementation: object, *, loaded: bool = False) -> None:
    """Refuse HF's attention names (``"sdpa"``, ``"flash_attention_2"``, ...) with FoT's own
    switch: FoT layers pick their attention by ``config.attn_backend``, never by HF's
    ``attn_implementation``. HF's generic error for ``"sdpa"`` says to ask transformers for
    support and to use ``"eager"``, which would leave the FoT backend as it was. ``None`` and
    ``"eager"`` (HF's defaults) are accepted.

    Args:
        attn_implementation: the name asked for.
        loaded: the model exists (``set_attn_implementation``): name the config field to set
            instead of the ``from_pretrained`` argument.

    Raises:
        ValueError: any other ``attn_implementation``.
    """
    if attn_implementation in (None, "eager"):
        return
    fix = (
        "set model.config.attn_backend (e.g. 'sdpa'), which the layers read on every call"
        if loaded
        else "pass e.g. attn_backend='auto' to from_pretrained"
    )
    raise ValueError(
        f"attn_implementation={attn_implementation!r} is not used by FoT models: they choose "
        f"attention by config.attn_backend, one of {list(ATTN_BACKENDS)} ('auto' = Triton "
        "kernels on CUDA, PyTorch elsewhere; 'sdpa' = PyTorch SDPA where there is no forget "
        f"gate, else as 'auto'). Drop attn_implementation and {fix}"
    )


class FoTPreTrainedModel(PreTrainedModel):
    """Weights init (N(0, initializer_range), paper App. E.11) and HF plumbing."""

    config_class = FoTConfig
    config: FoTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["FoTDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["past_key_values", "cache"]
    # The forget gate is computed in float32 (its logits feed a cumsum over the whole
    # sequence): from_pretrained(dtype=bf16 / fp16) keeps its projection's weights, and the
    # bias_only / fixed gates' per-head bias, in float32.
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["fgate_proj", "fgate_bias"]

    def __init__(self, config: FoTConfig, *inputs: Any, **kwargs: Any) -> None:
        """Check ``config`` again before building: a field set after the config was made
        (``config.num_heads = 3``, ``config.fgate_type = "bias-only"``) skipped the
        constructor's checks and would otherwise build a different model than it names.

        Raises:
            TypeError: ``config`` is not a :class:`FoTConfig`.
            ValueError: a field of ``config`` is invalid (named, with what to change).
        """
        if not isinstance(config, FoTConfig):
            raise TypeError(
                f"{type(self).__name__} needs a FoTConfig, got {type(config).__name__}; build "
                "one with fot.presets.config(...) or FoTConfig(...)"
            )
        config.validate_fot()
        super().__init__(config, *inputs, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """``PreTrainedModel.save_pretrained``, with the weight files readable as the umask allows
        (safetensors >= 0.8 leaves them at mode 0600; ``fot.export.make_weights_readable``)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        from fot.export import make_weights_readable

        make_weights_readable(save_directory)

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, *args, **kwargs
    ) -> str:
        """HF hook behind ``from_pretrained(attn_implementation=...)``: refuse HF's attention
        names with FoT's own switch (:func:`refuse_hf_attention`)."""
        refuse_hf_attention(attn_implementation)
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    def set_attn_implementation(
        self, attn_implementation: str | dict, *args: Any, **kwargs: Any
    ) -> None:
        """``PreTrainedModel.set_attn_implementation``, refusing HF's attention names as
        ``from_pretrained`` does (:func:`refuse_hf_attention`).

        transformers skips its check for FoT's classes (their attention does not go through its
        ``AttentionInterface``) and only logs that the model cannot switch, without naming
        ``config.attn_backend``, which switches a loaded model (``model.config.attn_backend =
        "sdpa"``).

        Raises:
            ValueError: ``attn_implementation`` (or its ``""`` entry) is not None or ``"eager"``.
        """
        name = attn_implementation
        if isinstance(name, dict):
            name = name.get("")
        refuse_hf_attention(name, loaded=True)
        super().set_attn_implementation(attn_implementation, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, FoTForgetGateProj):
                init.constant_(module.bias, self.config.fgate_bias_init)
            elif module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (FoTRMSNorm, FoTHeadRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, FoTAttention) and module.fgate_type in ("bias_only", "fixed"):
            cfg = self.config
            init.copy_(
                module.fgate_bias,
                long_init_bias(module.num_heads, cfg.decay_time_min, cfg.decay_time_max),
            )

    @torch.no_grad()
    def resize_token_embeddings(
        self,
        new_num_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        mean_resizing: bool = True,
    ) -> nn.Embedding:
        """Change the number of real tokens to ``new_num_tokens``, keeping the rows padded.

        Unlike the generic HF method (which would give the embedding exactly
        ``new_num_tokens`` rows while the config still implies padded ones, so the saved
        checkpoint no longer loads), this sets ``config.vocab_size = new_num_tokens`` and
        ``config.pad_vocab_multiple = pad_to_multiple_of`` (if given), and gives the embedding
        and the LM head ``config.padded_vocab_size`` rows: the model stays what its config
        builds, logits have ``new_num_tokens`` columns.

        Rows of tokens kept keep their weights. Tokens that become real (ids from the old
        ``vocab_size`` up to ``new_num_tokens``, including those that were padding rows, which
        were never trained) get the mean of the old real tokens' rows (embedding and LM head)
        with ``mean_resizing=True`` (HF samples around that mean with a tiny covariance; the
        mean itself is used here), else N(0, ``initializer_range``). Padding rows are drawn
        from N(0, ``initializer_range``) and never predicted.

        Args:
            new_num_tokens: new ``vocab_size``; None keeps it (then only
                ``pad_to_multiple_of`` changes, if given).
            pad_to_multiple_of: new ``pad_vocab_multiple``; None keeps it.
            mean_resizing: initialise new tokens with the old tokens' mean row.

        Returns:
            The (new) input embedding module.
        """
        cfg = self.config
        if new_num_tokens is None and pad_to_multiple_of is None:
            return self.get_input_embeddings()
        n = cfg.vocab_size if new_num_tokens is None else new_num_tokens
        multiple = cfg.pad_vocab_multiple if pad_to_multiple_of is None else pad_to_multiple_of
        for name, value in (("new_num_tokens", n), ("pad_to_multiple_of", multiple)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        rows = -(-n // multiple) * multiple
        old_vocab = cfg.vocab_size
        std = cfg.initializer_range

        def resized(weight: torch.Tensor) -> torch.Tensor:
            new = torch.empty(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            new.normal_(0.0, std)
            keep = min(old_vocab, n)
            new[:keep] = weight[:keep]
            if n > old_vocab and mean_resizing:
                new[old_vocab:n] = weight[:old_vocab].float().mean(0).to(weight.dtype)
            return new

        embed = self.get_input_embeddings()
        head = self.get_output_embeddings()
        if type(embed) is not nn.Embedding or (
            head is not None and (type(head) is not nn.Linear or head.bias is not None)
        ):
            raise ValueError(
                "resize_token_embeddings needs a plain nn.Embedding and a bias-free nn.Linear LM "
                f"head, got {type(embed).__name__} and {type(head).__name__}: resize before "
                "wrapping the model (adapters, quantisation)"
            )
        new_embed = nn.Embedding(rows, embed.embedding_dim, device=embed.weight.device)
        new_embed.weight = nn.Parameter(
            resized(embed.weight), requires_grad=embed.weight.requires_grad
        )
        self.set_input_embeddings(new_embed)
        if head is not None:
            new_head = nn.Linear(head.in_features, rows, bias=False, device=head.weight.device)
            new_head.weight = nn.Parameter(
                resized(head.weight), requires_grad=head.weight.requires_grad
            )
            self.set_output_embeddings(new_head)
        cfg.vocab_size, cfg.pad_vocab_multiple = n, multiple
        return new_embed

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The cache also holds the gate cumsum and the KV-shift state: the model makes its own
        # FoTCache (returned in the output, then fed back by generate()).
        return False


class FoTModel(FoTPreTrainedModel):
    """Embedding, blocks and final norm; returns hidden states ``[B, T, hidden]``."""

    def __init__(self, config: FoTConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [FoTDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = FoTRMSNorm(config.hidden_size, config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _context(
        self,
        B: int,
        T: int,
        device: torch.device,
        attention_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        past: int,
        step: StaticStep | None = None,
    ) -> _Context:
        if step is not None:
            # A static decode step: masks and positions from the device position, no host
            # value (the step may be captured as a CUDA graph and replayed at later positions).
            rope = None
            if self.config.use_rope:
                rope = rope_cos_sin(step.positions(), self.config.head_dim, self.config.rope_theta)
            key_mask = step.key_mask(self.config.window_size)  # (B, bucket)
            return _Context(rope, None, None, key_mask, None, window_in_key_mask=True)
        key_mask = query_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape != (B, past + T):
                raise ValueError(
                    f"attention_mask must be [B, past + T] = {(B, past + T)} (1 = token, 0 = "
                    f"padding), got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.to(device=device, dtype=torch.bool)
            if not bool(mask.all()):  # (a host sync; the trainer passes no attention_mask)
                key_mask, query_mask = mask, mask[:, past:]
                if self.config.window_size is not None:
                    _refuse_gaps_under_a_window(mask, self.config.window_size)
        doc_starts = None
        positions = None
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens (packed documents) needs batch size 1, got B={B}")
            if past:
                raise ValueError("cu_seqlens cannot be combined with a non-empty cache")
            if key_mask is not None:
                raise ValueError("cu_seqlens cannot be combined with padding in attention_mask")
            # Values are checked only where that needs no device sync (a CPU tensor, as the
            # trainer's batches have before the copy); the kernels' debug mode checks the rest.
            if cu_seqlens.dim() != 1 or (
                cu_seqlens.device.type == "cpu"
                and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T)
            ):
                raise ValueError(
                    f"cu_seqlens must be 1-D, start at 0 and end at T={T}, got "
                    f"{cu_seqlens.tolist()[:8]}"
                )
            cu = cu_seqlens.to(device=device, dtype=torch.long)
            t = torch.arange(T, device=device)
            doc = torch.searchsorted(cu[1:], t, right=True)  # (T,) document of each position
            positions = (t - cu[doc])[None]  # (1, T)
            doc_starts = positions[0] == 0  # (T,) first token of each (non-empty) document
        if self.config.use_rope and positions is None:
            if attention_mask is not None:
                # Left padding: real tokens count from 0 (RoPE is relative, so this only keeps
                # absolute angles small; results match the unpadded sequence).
                pos = attention_mask.to(device).long().cumsum(-1) - 1
                positions = pos.clamp(min=0)[:, past:]
            else:
                positions = (past + torch.arange(T, device=device))[None].expand(B, T)
        rope = None
        if self.config.use_rope:
            rope = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        return _Context(rope, cu_seqlens, doc_starts, key_mask, query_mask)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: FoTCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        cache: FoTCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        """Hidden states of the last layer (after the final norm).

        Args:
            input_ids: ``[B, T]`` int64 token ids (or ``inputs_embeds`` ``[B, T, hidden]``),
                each in ``0 .. vocab_size - 1``: others are refused on CPU tensors in eval
                mode and in ``generate()`` (:func:`refuse_out_of_vocab`), unchecked in training
                and on GPUs (a host sync per step; the trainer checks its data up front).
            attention_mask: ``[B, past + T]`` 1 for tokens, 0 for padding (left padding in
                generation); ``None`` = no padding. A 0 anywhere removes its token exactly;
                with ``window_size`` a 0 between 1s is refused (the window counts positions).
            past_key_values: a :class:`FoTCache` from a previous call.
            use_cache: return a (new or updated) :class:`FoTCache`. Default False. Ignored,
                with a warning, under gradient checkpointing in training (a ``past_key_values``
                is refused there).
            cu_seqlens: ``[N + 1]`` cumulative document lengths (packed documents, ``B == 1``):
                attention, gate cumsum, KV-shift and RoPE positions restart per document.
            output_hidden_states: also return ``hidden_states``, ``num_hidden_layers + 1``
                tensors ``[B, T, hidden]``: the embeddings, the residual stream after each block,
                the last one after the final norm (``last_hidden_state``), as HF's LLaMA does.
                Default ``config.output_hidden_states``.
            output_attentions: must be false: the attention kernels never form the attention
                matrix (a ``ValueError`` otherwise).
            return_dict: False returns ``output.to_tuple()``. Default ``config.return_dict``.
            cache: the same as ``past_key_values`` (transformers' name from 5.24 on).
            **kwargs: Hugging Face's packing keys, see :func:`hf_packing_kwargs`
                (``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` /
                ``position_ids``) and ``cache_position`` (ignored: the cache knows its length).
                Any other key with a value other than None raises ``TypeError``.

        Returns:
            ``BaseModelOutputWithPast`` with ``last_hidden_state`` ``[B, T, hidden]``, the cache
            (field :data:`CACHE_FIELD`) when caching and ``hidden_states`` when asked, or its
            tuple.
        """
        past_key_values = _one_cache(past_key_values, cache)
        _check_input_shapes(self.config, input_ids, inputs_embeds)
        hidden_states = _output_flags(self.config, output_hidden_states, output_attentions)
        if inputs_embeds is None:
            # checked only where it costs no host sync: on the CPU outside training (the
            # trainer checks its data's ids up front); generate() checks on GPUs too
            if input_ids.device.type == "cpu" and not self.training:
                refuse_out_of_vocab(input_ids, self.config.vocab_size)
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, hidden)
        B, T, _ = inputs_embeds.shape
        if T == 0:
            raise ValueError(
                f"the input has no tokens (shape {tuple(inputs_embeds.shape[:2])}): pass at "
                "least one token per row, e.g. the tokenizer's bos_token_id for an empty prompt"
            )
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # the backward pass recomputes each block, which would write its tokens again
            if past_key_values is not None:
                raise ValueError(
                    "past_key_values cannot be used with gradient checkpointing in training: "
                    "recomputing a block in the backward pass would add its tokens to the "
                    "cache a second time. Call model.gradient_checkpointing_disable(), or "
                    "model.eval() / torch.no_grad() for generation"
                )
            if use_cache:
                logger.warning_once(
                    "use_cache=True is incompatible with gradient checkpointing in training "
                    "(the backward pass would fill the cache twice): no cache is returned"
                )
                use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = FoTCache(self.config.num_hidden_layers)
        if past_key_values is not None and not isinstance(past_key_values, FoTCache):
            raise TypeError(
                f"past_key_values must be a fot.models.FoTCache, got {type(past_key_values).__name__}: "
                "FoT layers cache the running forget-gate cumsum and KV-shift state besides K "
                "and V, which HF's caches (DynamicCache, StaticCache, ...) cannot hold. Omit "
                "past_key_values (generate() and forward(use_cache=True) create a FoTCache), "
                "pass the one a previous call returned, or start one with "
                "fot.models.FoTCache(config.num_hidden_layers)"
            )
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        cached_rows = past_key_values[0].keys.shape[0] if past and len(past_key_values) else B
        if cached_rows != B:
            # e.g. a prompt cache of one sequence passed to generate(num_beams=4): generate
            # expands the inputs but never a cache it is given
            if cached_rows > B:
                # e.g. the cache a beam search returned (one row per beam, in the order of its
                # last step) passed back with the sequences it chose
                fix = (
                    "a cache holds one row per sequence it was built for: one a beam search "
                    "returned holds every beam's, which are not the sequences it returned, and "
                    "cannot be continued from. Pass no cache (the prompt is run again), or the "
                    "cache of a greedy or sampling generate() with its sequences"
                )
            else:
                fix = (
                    "generate() repeats the inputs for num_beams / num_return_sequences, not a "
                    "cache passed to it: repeat the cache first (cache.batch_repeat_interleave(n) "
                    "for n beams or returned sequences), or pass no cache"
                )
            raise ValueError(
                f"past_key_values holds {cached_rows} sequences but the input has {B} rows. " + fix
            )
        if kwargs:  # never on the training path (input_ids, cu_seqlens only): no cost there
            cu_seqlens = hf_packing_kwargs(
                kwargs, cu_seqlens, (B, T), attention_mask, past, inputs_embeds.device
            )
        step = past_key_values.step if past_key_values is not None else None
        ctx = self._context(B, T, inputs_embeds.device, attention_mask, cu_seqlens, past, step)
        branch, residual = inputs_embeds, None  # the stream is residual + branch
        states = [inputs_embeds] if hidden_states else None
        for i, layer in enumerate(self.layers):
            branch, residual = layer(branch, residual, ctx, past_key_values=past_key_values)
            if states is not None and i < len(self.layers) - 1:
                states.append(residual + branch)  # the stream after block i
        h, _ = self.norm.add_norm(
            branch, residual, _use_fused_eager(self.config.attn_backend, branch)
        )
        out = BaseModelOutputWithPast(
            last_hidden_state=h,
            hidden_states=(*states, h) if states is not None else None,
            **{CACHE_FIELD: past_key_values},
        )
        return out if _return_dict(self.config, return_dict) else out.to_tuple()


def _check_labels(name: str, labels: torch.Tensor, shape: tuple[int, int]) -> None:
    """Refuse ``labels`` / ``shift_labels`` that are not integer token ids ``[B, T]`` like the
    input (a float tensor would be cast to token ids, a wrong shape fail deep in the loss)."""
    if not torch.is_tensor(labels):
        raise TypeError(
            f"{name} must be a tensor of token ids [B, T] = {shape}, got {type(labels).__name__}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(
            f"{name} must hold integer token ids (-100 to ignore a position), got {labels.dtype}"
        )
    if tuple(labels.shape) != shape:
        raise ValueError(
            f"{name} must be [B, T] = {shape} like input_ids, got {tuple(labels.shape)}"
        )


def _refuse_gaps_under_a_window(mask: torch.Tensor, window_size: int) -> None:
    """Refuse a 0 between two 1s of a row of ``mask`` ``[B, past + T]`` (bool) in a model with
    a sliding window. Elsewhere such a gap removes its tokens exactly (their forget gates are
    1, the KV-shift skips them, RoPE positions count real tokens only), but the window counts
    positions: a query after a gap would see fewer real tokens than the same row without it.
    Left and right padding leave no gap."""
    seen = mask.int().cummax(dim=1).values.bool()  # (B, N) a real token at or before
    later = mask.flip(1).int().cummax(dim=1).values.flip(1).bool()  # (B, N) one at or after
    gaps = (~mask & seen & later).any(dim=1)  # (B,)
    if bool(gaps.any()):
        rows = gaps.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask has a 0 between tokens (a 1 before and after it) in row(s) {rows}: "
            f"with window_size={window_size} the sliding window counts positions, masked ones "
            "included, so the result would differ from the row without those tokens. Pad on "
            "the left (tokenizer.padding_side = 'left') or on the right only, or leave the "
            "masked tokens out of input_ids"
        )


def refuse_right_padding(attention_mask: object) -> None:
    """``generate()`` check: refuse an ``attention_mask`` ``[B, T]`` that is 0 at the last
    position of a row (right padding). Each row's next token is predicted from the last
    position's logits, so such a row would continue from a padding token: silently another
    text than the prompt alone gives (transformers only logs a warning, and only when it knows
    a pad token and the batch has several rows)."""
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
        return
    if attention_mask.shape[1] == 0:
        return
    last = attention_mask[:, -1]
    padded = (last == 0).nonzero().flatten().tolist()
    if padded:
        rows = ", ".join(map(str, padded[:8])) + (", ..." if len(padded) > 8 else "")
        raise ValueError(
            f"generate(): attention_mask is 0 at the last position of row(s) {rows} (right "
            "padding), so those rows would continue from a padding token instead of their "
            "last token. Pad on the left: tokenizer.padding_side = 'left' (the exported "
            "tokenizer pads on the left), or generate each prompt alone"
        )


def refuse_continuous_batching(model: nn.Module, state: str) -> None:
    """Refuse transformers' continuous batching (``generate_batch``,
    ``init_continuous_batching``) for ``model``, whose layers keep ``state`` besides K and V.

    Continuous batching swaps the model's attention for transformers' paged one and its cache
    for a paged K/V cache; these layers run their own attention over their own cache.

    Raises:
        NotImplementedError: always, naming ``generate()`` as the way to decode a batch.
    """
    raise NotImplementedError(
        f"{type(model).__name__} cannot run transformers' continuous batching (generate_batch, "
        "init_continuous_batching): it runs transformers' attention over a paged K/V cache, "
        f"and these layers run their own over a cache that also keeps {state}. Decode a batch of prompts with generate() instead: tok(prompts, "
        "padding=True, return_tensors='pt') (the exported tokenizer pads on the left), then "
        "model.generate(**inputs, max_new_tokens=...)"
    )


def refuse_out_of_vocab(input_ids: object, vocab_size: int) -> None:
    """Refuse token ids outside ``0 .. vocab_size - 1`` in ``input_ids`` ``[B, T]`` with a
    ``ValueError`` naming the id: the embedding would fail deep inside (an ``IndexError`` on
    the CPU, a device-side assert on CUDA) or, for an id among the padding rows
    (``vocab_size`` up to ``padded_vocab_size``), silently read an untrained row.

    It reads the smallest and largest id back to the host (a sync on CUDA), so it runs once per
    ``generate()`` call (and in an eval-mode forward on CPU tensors, where it costs no sync),
    never in a forward on the GPU or in training.

    Args:
        input_ids: the token ids; anything but an integer tensor is left alone.
        vocab_size: ``config.vocab_size``.

    Raises:
        ValueError: an id is negative or at least ``vocab_size``.
    """
    if not torch.is_tensor(input_ids) or input_ids.numel() == 0:
        return
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one host sync
    if high >= vocab_size:
        raise ValueError(
            f"input_ids holds token id {high}, but the model's vocab_size is {vocab_size} (ids "
            f"0 to {vocab_size - 1}): the tokenizer does not match the model; encode with the "
            "tokenizer saved with the model, or resize_token_embeddings(len(tokenizer))"
        )
    if low < 0:
        raise ValueError(
            f"input_ids holds the negative token id {low}: token ids run from 0 to "
            f"{vocab_size - 1} (-100 marks ignored positions in labels, not in input_ids); pad "
            "with the tokenizer's pad_token_id and mark padding in attention_mask"
        )


# Keys that ``generate()`` and HF collators may pass and that change nothing here.
_HARMLESS_KWARGS = frozenset({"cache_position", "max_length_q", "max_length_k"})
# generate() keyword arguments that HF leaves among the model inputs but no forward reads
_GENERATE_ONLY_KWARGS = ("tokenizer", "assistant_tokenizer")


def _check_input_shapes(
    config: FoTConfig, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> None:
    """Exactly one of ``input_ids`` ``[B, T]`` (integer ids) and ``inputs_embeds``
    ``[B, T, hidden]``, else a ``ValueError`` naming the shape or dtype (not an unpacking or
    embedding error from deep inside)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None and input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}; for one "
            "sequence add the batch dimension: input_ids[None]"
        )
    if input_ids is not None and (input_ids.is_floating_point() or input_ids.is_complex()):
        raise ValueError(
            f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; convert them "
            "with input_ids.long()"
        )
    if inputs_embeds is not None and (
        inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size
    ):
        raise ValueError(
            f"inputs_embeds must be [batch, time, hidden_size={config.hidden_size}], got shape "
            f"{tuple(inputs_embeds.shape)}; make them with model.get_input_embeddings()(ids)"
        )


def _output_flags(
    config: FoTConfig, output_hidden_states: bool | None, output_attentions: bool | None
) -> bool:
    """Resolve HF's ``output_*`` flags against the config; return ``output_hidden_states``.

    Raises:
        ValueError: attentions were asked for (the kernels never form the attention matrix), or
            ``output_hidden_states`` is not a bool.
    """
    if output_attentions is None:
        output_attentions = getattr(config, "output_attentions", False)
    if output_attentions:
        raise ValueError(
            "output_attentions=True is not supported: FoT's attention kernels never form the "
            "attention matrix (flash-style). Pass output_attentions=False, or compute the "
            "weights from the layer's q, k and log forget gates yourself"
        )
    if output_hidden_states is None:
        output_hidden_states = getattr(config, "output_hidden_states", False)
    if not isinstance(output_hidden_states, bool):
        raise ValueError(
            f"output_hidden_states must be True or False, got {output_hidden_states!r}; select "
            "layers from the returned tuple instead"
        )
    return output_hidden_states


def _return_dict(config: FoTConfig, return_dict: bool | None) -> bool:
    """HF's ``return_dict`` argument, defaulting to ``config.return_dict``."""
    return getattr(config, "return_dict", True) if return_dict is None else bool(return_dict)


def hf_packing_kwargs(
    kwargs: dict,
    cu_seqlens: torch.Tensor | None,
    shape: tuple[int, int],
    attention_mask: torch.Tensor | None,
    past: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Packed-document boundaries from the keys Hugging Face's padding-free collators emit.

    ``DataCollatorWithFlattening`` concatenates a batch into one row ``[1, total]`` and marks
    the documents with ``position_ids`` (restarting at every document) and, with
    ``return_flash_attn_kwargs=True``, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` /
    ``max_length_q`` / ``max_length_k``. FoT takes the boundaries as ``cu_seqlens``:

    * ``cu_seq_lens_q`` / ``cu_seq_lens_k`` are used as ``cu_seqlens`` (they must be equal:
      FoT is causal self-attention; converted to int32 on the model's device). The
      ``max_length_*`` keys are derived from them and ignored.
    * ``position_ids`` without boundaries: a new document starts wherever a position is not
      the previous one + 1 (between two real tokens of ``attention_mask``), so the collator's
      default output packs correctly too. Positions that never restart (``arange``, from any
      offset) change nothing: FoT's positions are relative (RoPE) or unused, and a cache
      knows its own offset. Restarts need batch size 1 and no cache (as ``cu_seqlens``).
      With ``cu_seqlens`` (or ``cu_seq_lens_q``) given, ``position_ids`` are not read.
      Deriving the boundaries reads ``position_ids`` on the host (one sync).

    Args:
        kwargs: the extra keyword arguments of ``forward``.
        cu_seqlens: the ``cu_seqlens`` argument, or None.
        shape: ``(B, T)`` of the new tokens.
        attention_mask: ``[B, past + T]`` or None.
        past: cached positions before the new tokens.
        device: the model's input device.

    Returns:
        ``cu_seqlens`` ``[N + 1]`` (int32), or None for unpacked sequences.

    Raises:
        TypeError: a key other than these (and ``cache_position``) with a value that is not None
            (it would otherwise be ignored silently).
        ValueError: unequal ``cu_seq_lens_q`` and ``cu_seq_lens_k``, both ``cu_seqlens`` and
            ``cu_seq_lens_*``, a bad ``position_ids`` shape, or restarting positions with
            ``B > 1`` or a cache.
    """
    cu_q = kwargs.pop("cu_seq_lens_q", None)
    cu_k = kwargs.pop("cu_seq_lens_k", None)
    position_ids = kwargs.pop("position_ids", None)
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _HARMLESS_KWARGS)
    if unknown:
        raise TypeError(
            f"FoT models do not support the keyword arguments {unknown} (they would be ignored "
            "silently). Packed documents: pass cu_seqlens (or HF's cu_seq_lens_q / "
            "cu_seq_lens_k / position_ids); labels: labels or shift_labels"
        )
    B, T = shape
    if cu_q is not None or cu_k is not None:
        if cu_seqlens is not None:
            raise ValueError(
                "pass the document boundaries once: either cu_seqlens or cu_seq_lens_q / "
                "cu_seq_lens_k, not both"
            )
        cu_q = torch.as_tensor(cu_q if cu_q is not None else cu_k)
        cu_k = torch.as_tensor(cu_k) if cu_k is not None else cu_q
        if cu_k is not cu_q and (
            cu_q.shape != cu_k.shape or not torch.equal(cu_q, cu_k.to(cu_q.device))
        ):
            raise ValueError(
                f"cu_seq_lens_q {cu_q.tolist()[:8]} and cu_seq_lens_k {cu_k.tolist()[:8]} "
                "differ: FoT is causal self-attention over packed documents, whose query and "
                "key boundaries are the same; pass equal ones (or cu_seqlens)"
            )
        return cu_q.to(device=device, dtype=torch.int32)
    if position_ids is None or cu_seqlens is not None:
        return cu_seqlens
    pos = torch.as_tensor(position_ids, device=device)
    pos = pos[None] if pos.dim() == 1 else pos
    if pos.dim() != 2 or pos.shape[1] != T or pos.shape[0] not in (1, B):
        raise ValueError(
            f"position_ids must be [B, T] = {(B, T)} (or [1, T]), got {tuple(pos.shape)}"
        )
    restart = pos[:, 1:] != pos[:, :-1] + 1  # (B, T - 1): True where a new document starts
    if attention_mask is not None and tuple(attention_mask.shape) == (B, past + T):
        real = attention_mask[:, past:].to(device=device, dtype=torch.bool)  # (B, T)
        restart = restart & real[:, 1:] & real[:, :-1]  # padding is no document boundary
    starts = restart.nonzero()  # (n, 2) rows and positions - 1; one host sync
    if starts.numel() == 0:
        return None
    if B != 1 or past:
        where = (starts[:, 1] + 1).unique()[:8].tolist()
        raise ValueError(
            f"position_ids restart within a row (packed documents) at positions {where}, but "
            f"packed documents need batch size 1 and no cache (got B={B}, {past} cached "
            "positions): flatten the documents into one row (DataCollatorWithFlattening does) "
            "or pass cu_seqlens"
        )
    inner = (starts[:, 1] + 1).to(torch.int32)
    edge = torch.tensor([0], dtype=torch.int32, device=device)
    return torch.cat([edge, inner, edge + T])


def _chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_size: int,
    fp32_logits: bool = False,
) -> torch.Tensor:
    """Per-row cross-entropy of ``hidden @ weight.T`` without materialising all logits.

    Args:
        hidden: ``[N, hidden]``; labels: ``[N]`` int64 (-100 = ignore).
        weight: ``[V, hidden]``, or a head ``[n, hidden] -> [n, V]`` logits (a wrapped LM
            head, called as it is).
        chunk_size: rows whose fp32 logits exist at once; under autograd each chunk is
            checkpointed, so backward also holds one chunk's logits at a time.
        fp32_logits: compute the logits in fp32 with autocast off (evaluation; a head module
            then runs in its own weights' dtype); otherwise in the autocast/model dtype, then
            upcast for the softmax (training).

    Returns:
        ``[N]`` float32 losses (float64 for a float64 model), 0 at ignored rows.
    """

    def _rows(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not isinstance(weight, torch.Tensor):
            off = torch.autocast(h.device.type, enabled=False)
            with off if fp32_logits else contextlib.nullcontext():
                # on the labels' device: a head that a device map put on another GPU returns
                # its logits there
                logits = at_least_fp32(weight(h)).to(y.device)  # (n, V)
        elif fp32_logits:  # evaluation: exact logits even under a bf16 autocast
            dtype = torch.promote_types(h.dtype, torch.float32)
            with torch.autocast(h.device.type, enabled=False):
                logits = F.linear(h.to(dtype), weight.to(dtype))  # (n, V)
        else:
            logits = at_least_fp32(F.linear(h, weight))  # (n, V)
        return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="none")

    trainable = not isinstance(weight, torch.Tensor) or weight.requires_grad
    grad = torch.is_grad_enabled() and (hidden.requires_grad or trainable)
    out = []
    for s in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[s : s + chunk_size], labels[s : s + chunk_size]
        out.append(checkpoint(_rows, h, y, use_reentrant=False) if grad else _rows(h, y))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


# Bias of the LM head's padding rows in the fused loss: exp(-1e4 + |logit|) is exactly 0 in
# float32 for any logit a trained model produces, and -1e4 is finite (no inf - inf = NaN).
PADDING_LOGIT_BIAS = -1.0e4


def _fla_fused_linear_ce() -> type | None:
    """FLA's fused linear cross-entropy class, or None where FLA is not installed."""
    try:
        from fla.modules import FusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return FusedLinearCrossEntropyLoss


class BosPadGenerationMixin:
    """``generate`` without an ``attention_mask`` attends to the whole prompt where the pad id
    is the BOS id (fot's GPT-2 tokenizer: ``<|endoftext|>``, 50256, is both, and starts every
    tokenized text). transformers infers the mask from the pad id whenever ``eos_token_id``
    differs from it (``eos_token_id=198`` to stop at a newline): that masked the BOS, which the
    forward then leaves out, and the output was that of the prompt without it. A padded batch
    passes the tokenizer's ``attention_mask``, as with any model."""

    def _prepare_attention_mask_for_generation(
        self, inputs_tensor: torch.Tensor, generation_config: Any, model_kwargs: dict[str, Any]
    ) -> torch.Tensor:
        pad = generation_config.pad_token_id
        bos = generation_config.bos_token_id
        if bos is None:
            bos = getattr(self.config, "bos_token_id", None)
        if pad is not None and pad == bos:
            if "input_ids" in model_kwargs and model_kwargs["input_ids"].shape[1] > 0:
                inputs_tensor = model_kwargs["input_ids"]
            return torch.ones(
                inputs_tensor.shape[:2], dtype=torch.long, device=inputs_tensor.device
            )
        return super()._prepare_attention_mask_for_generation(  # type: ignore[misc]
            inputs_tensor, generation_config, model_kwargs
        )


class FoTForCausalLM(BosPadGenerationMixin, FoTPreTrainedModel, GenerationMixin):
    """FoT / Transformer language model with an untied, vocab-padded LM head.

    ``forward`` returns ``CausalLMOutputWithPast``. When a loss is requested (``labels`` or
    ``shift_labels``) the ``[T, V]`` logits are never materialised as a whole (our fused linear
    cross-entropy on CUDA, ``fot.kernels.linear_cross_entropy``; chunked cross-entropy
    elsewhere; see ``FoTConfig.loss_impl``) and ``.logits`` is ``None``, except with HF-style
    ``labels`` in eval mode, which return the logits too, as HF models do.
    """

    def __init__(self, config: FoTConfig) -> None:
        super().__init__(config)
        self.model = FoTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @property
    def _head_weight(self) -> torch.Tensor:
        """``[vocab_size, hidden]``: the LM head without its padding rows (never predicted)."""
        return self.lm_head.weight[: self.config.vocab_size]

    def _head(self, device: torch.device) -> torch.Tensor | Callable[[torch.Tensor], torch.Tensor]:
        """What the loss multiplies hidden states on ``device`` by: :attr:`_head_weight`; for
        an LM head that is not :func:`plain_linear` (wrapped, hooked) or has a bias, the module
        itself, its logits cut to ``vocab_size``."""
        if _fusable(self.lm_head, device):
            return self._head_weight
        return lambda h: self.lm_head(h)[..., : self.config.vocab_size]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, vocab_size]`` float32 logits of the hidden states ``[B, T, hidden]``
        (float64 for a float64 model)."""
        head = self._head(hidden.device)
        logits = F.linear(hidden, head) if isinstance(head, torch.Tensor) else head(hidden)
        return at_least_fp32(logits)

    def _padded_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole LM head ``[padded_vocab, hidden]`` and a bias ``[padded_vocab]`` (weight's
        dtype) that is 0 for real tokens and -1e4 for the padding rows (None without padding).

        Equivalent to the head cut to ``vocab_size`` rows (the padding logits' softmax weight
        underflows to exactly 0, so they get zero gradient), but keeps the logits' row length a
        multiple of ``pad_vocab_multiple``: 50257-wide rows force unaligned, several times slower
        GEMM kernels.
        """
        weight = self.lm_head.weight
        pad = weight.shape[0] - self.config.vocab_size
        if pad == 0:
            return weight, None
        bias = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
        bias[self.config.vocab_size :] = PADDING_LOGIT_BIAS
        return weight, bias

    def _loss_per_token(
        self, hidden: torch.Tensor, shift_labels: torch.Tensor, fp32_logits: bool = False
    ) -> torch.Tensor:
        """``[B, T]`` float32 next-token losses (0 where ``shift_labels == -100``)."""
        B, T, H = hidden.shape
        labels = shift_labels.to(hidden.device).reshape(-1).long()
        losses = _chunked_cross_entropy(
            hidden.reshape(B * T, H),
            self._head(hidden.device),
            labels,
            self.config.loss_chunk_size,
            fp32_logits=fp32_logits,
        )
        return losses.view(B, T)

    def _mean_loss(
        self,
        hidden: torch.Tensor,
        shift_labels: torch.Tensor,
        num_items: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sum of the next-token losses over the non-ignored positions, divided by their count
        or by ``num_items`` (HF ``Trainer``'s ``num_items_in_batch``, counted over all
        micro-batches of a step); on device, no host sync either way."""
        impl = self.config.loss_impl
        if impl == "auto":
            impl = "fused" if hidden.is_cuda else "chunked"
        if not _fusable(self.lm_head, hidden.device) or hidden.dtype == torch.float64:
            impl = "chunked"  # the fused losses read the weight, and compute in float32
        B, T, H = hidden.shape
        _check_labels("shift_labels", shift_labels, (B, T))  # shape and dtype: no sync
        labels = shift_labels.to(hidden.device).reshape(-1).long()
        # Sum, then divide on device: no host sync, and an all-ignored batch gives 0.
        if num_items is None:
            count = (labels != IGNORE_INDEX).sum().clamp(min=1)
        elif isinstance(num_items, torch.Tensor):
            count = num_items.to(hidden.device, non_blocking=True).clamp(min=1)
        else:
            count = max(int(num_items), 1)
        if impl == "fused":
            from fot.kernels.loss_ops import linear_cross_entropy

            total = linear_cross_entropy(
                hidden.reshape(B * T, H),
                self.lm_head.weight,  # the whole padded head: aligned GEMMs
                labels,
                n_classes=self.config.vocab_size,
                ignore_index=IGNORE_INDEX,
                chunk_rows=self.config.loss_chunk_size,
            )
            return total / count
        if impl == "fla":
            fused = _fla_fused_linear_ce()
            if fused is None:
                raise ImportError(
                    "loss_impl='fla' needs flash-linear-attention (fla.modules."
                    "FusedLinearCrossEntropyLoss); install it or use loss_impl='fused'"
                )
            fn = fused(ignore_index=IGNORE_INDEX, reduction="sum")
            weight, bias = self._padded_head()
            # FLA accumulates the weight gradient with a float32 GEMM (CUDA cores unless TF32
            # is on: 48 ms of a 593 ms 760M step on an H200). In 16-bit training its inputs are
            # 16-bit values (exact in TF32) or, under autocast, activations that every other
            # GEMM rounds to bf16 anyway, so TF32 costs no accuracy there; fp32 runs keep fp32.
            tf32 = hidden.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(
                "cuda"
            )
            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = prev or tf32
            try:
                total = fn(hidden.reshape(B * T, H), labels, weight, bias)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = prev
            return total / count
        return self._loss_per_token(hidden, shift_labels).sum() / count

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_key_values: FoTCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        cache: FoTCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Language-model forward.

        Args:
            input_ids: ``[B, T]`` int64.
            attention_mask: ``[B, past + T]`` (1 = token, 0 = padding) or None.
            labels: ``[B, T]`` HF-style labels (shifted inside: position t predicts labels[t+1]).
            cu_seqlens: ``[N + 1]`` packed document boundaries (``B == 1``).
            past_key_values: :class:`FoTCache` from a previous call.
            use_cache: return the cache (default False; ``generate()`` sets it).
            logits_to_keep: if > 0, logits only for the last ``logits_to_keep`` positions;
                a 1-D tensor: logits only at those positions (as in HF models).
            return_dict: False returns ``output.to_tuple()``. Default ``config.return_dict``.
            output_hidden_states: also return ``hidden_states`` (see :meth:`FoTModel.forward`).
            output_attentions: must be false (``ValueError``: no attention matrix is formed).
            cache: the same as ``past_key_values`` (transformers' name from 5.24 on).
            **kwargs: ``shift_labels`` ``[B, T]``: next-token labels (-100 = ignore), taking
                precedence over ``labels`` (a keyword argument, not a named parameter, as in HF
                models: HF's ``Trainer`` then requires only ``labels`` in its batches).
                ``num_items_in_batch``: int or 0-d tensor, what HF's ``Trainer`` passes under
                gradient accumulation: the loss is then ``sum of token losses /
                num_items_in_batch`` instead of the mean over this batch. HF's packing keys
                (``cu_seq_lens_q``, ``position_ids``, ...; :func:`hf_packing_kwargs`); other
                keys raise ``TypeError`` unless None.

        Returns:
            ``CausalLMOutputWithPast`` (or its tuple): ``loss`` (mean over non-ignored positions,
            or the sum over ``num_items_in_batch``) when labels are given; ``logits``
            ``[B, T, vocab_size]`` float32 without labels and, as in HF models, with ``labels``
            in eval mode (HF ``Trainer.evaluate`` / ``predict`` pass them to
            ``compute_metrics``), but ``None`` with ``shift_labels`` or in training mode (the
            loss never forms them); and the cache when caching
            (field :data:`CACHE_FIELD`: ``past_key_values``, or ``cache`` from transformers 5.24
            on).
        """
        shift_labels = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        cache = past_key_values = _one_cache(past_key_values, cache)
        if (
            isinstance(cache, FoTCache)
            and cache.capacity is not None
            and input_ids is not None
            and input_ids.dim() == 2  # others: FoTModel names the shape
            and input_ids.shape[1] == 1
            and cache.get_seq_length() > 0
            and inputs_embeds is None
            and labels is None
            and shift_labels is None
            and cu_seqlens is None
            and all(v is None or k in _HARMLESS_KWARGS for k, v in kwargs.items())
            and not _output_flags(self.config, output_hidden_states, output_attentions)
        ):
            # One decode step with a fixed-capacity cache: device-side positions, replayed as a
            # CUDA graph where the cache captures them.
            def run(ids: torch.Tensor) -> torch.Tensor:
                out = self.model(
                    input_ids=ids, past_key_values=cache, use_cache=True, return_dict=True
                )
                return self._logits(out.last_hidden_state)  # (B, 1, V)

            logits = cache.static_step(run, input_ids, attention_mask)
            result = CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: cache})
            return result if _return_dict(self.config, return_dict) else result.to_tuple()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            **kwargs,
        )
        hidden = out.last_hidden_state  # (B, T, hidden)
        # HF-style `labels` outside training (HF Trainer's evaluate / predict, which hand the
        # logits to compute_metrics) return the logits with the loss, as HF models do.
        want_logits = shift_labels is None and (labels is None or not self.training)
        if shift_labels is None and labels is not None:  # shift_labels: in _loss_per_token
            _check_labels("labels", labels, tuple(hidden.shape[:2]))
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        loss = logits = None
        if shift_labels is not None:
            loss = self._mean_loss(hidden, shift_labels, num_items)
        if want_logits:
            if torch.is_tensor(logits_to_keep) and logits_to_keep.dim() == 1:
                # HF's other form: the positions to keep (a packed batch's last tokens)
                hidden = hidden[:, logits_to_keep.to(hidden.device)]
            elif logits_to_keep:
                hidden = hidden[:, -int(logits_to_keep) :]
            logits = self._logits(hidden)  # (B, T, V)
        result = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=out.hidden_states,
            **{CACHE_FIELD: getattr(out, CACHE_FIELD)},
        )
        return result if _return_dict(self.config, return_dict) else result.to_tuple()

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, *args, **kwargs
    ) -> None:
        """``generate()`` hook: start with an empty :class:`FoTCache` (HF's default caches hold
        K and V only), so that chunked prefill (``prefill_chunk_size``) works too.

        On CUDA (with ``config.decode_cuda_graphs``) the cache gets a fixed capacity of
        ``generate``'s maximum length and replays its decode steps as CUDA graphs. A
        fixed-capacity :class:`FoTCache` passed in (the one an earlier ``generate()`` returned,
        to continue from it, or one the user made) is enlarged to this call's maximum length
        when it is smaller (:meth:`FoTCache.grow`).
        """
        # transformers passes (generation_mode, batch_size, max_cache_length) after these
        max_len = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
        given = model_kwargs.get(CACHE_FIELD)
        if isinstance(given, FoTCache) and given.capacity is not None and isinstance(max_len, int):
            given.grow(max_len + 1)
        if given is None and generation_config.use_cache is not False:
            graphs = bool(
                self.config.decode_cuda_graphs
                and self.device.type == "cuda"
                and _on_one_device(self)
                and isinstance(max_len, int)
                and max_len > 0
            )
            if generation_config.cache_implementation is not None:
                logger.warning(
                    "cache_implementation=%r is not used by FoT models: generate() runs with a "
                    "FoTCache (it holds the forget-gate cumsum and the KV-shift state besides K "
                    "and V); on CUDA its decode steps are replayed as CUDA graphs when "
                    "config.decode_cuda_graphs is true",
                    generation_config.cache_implementation,
                )
            model_kwargs[CACHE_FIELD] = FoTCache(
                self.config.num_hidden_layers,
                capacity=max_len + 1 if graphs else None,
                cuda_graphs=graphs,
            )
            return
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        *args,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> dict:
        """``generate()`` hook: HF's inputs for the next forward, less generate-only keys.

        ``generate(..., tokenizer=tok)`` (needed by ``stop_strings`` and token healing) leaves
        ``tokenizer`` among the model keyword arguments that HF passes on to every forward;
        HF models swallow it in ``**kwargs``, but FoT's forward refuses unknown keys, so it is
        dropped here. Everything else goes to ``GenerationMixin.prepare_inputs_for_generation``
        unchanged (its other parameters differ between transformers releases);
        ``inputs_embeds`` is named because ``generate`` looks for it in this signature.

        Args:
            input_ids: ``[B, T]`` all tokens so far.
            *args: passed on.
            inputs_embeds: ``[B, T, hidden]`` prompt embeddings (prefill only), or None.
            **kwargs: passed on (the cache, ``attention_mask``, ...).

        Returns:
            The keyword arguments of the next forward call.
        """
        for key in _GENERATE_ONLY_KWARGS:
            kwargs.pop(key, None)
        return super().prepare_inputs_for_generation(
            input_ids, *args, inputs_embeds=inputs_embeds, **kwargs
        )

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """``generate()`` hook: also refuse a right-padded ``attention_mask``
        (:func:`refuse_right_padding`)."""
        refuse_right_padding(model_kwargs.get("attention_mask"))
        super()._validate_model_kwargs(model_kwargs)

    def _prepare_model_inputs(self, *args, **kwargs) -> tuple:
        """``generate()`` hook, once per call: also refuse prompt token ids outside the
        vocabulary (:func:`refuse_out_of_vocab`) before any forward (on CUDA a device-side
        assert would end the process's use of the GPU)."""
        inputs, input_name, model_kwargs = super()._prepare_model_inputs(*args, **kwargs)
        if input_name == "input_ids":
            refuse_out_of_vocab(inputs, self.config.vocab_size)
        return inputs, input_name, model_kwargs

    def init_continuous_batching(self, *args: Any, **kwargs: Any) -> None:
        """Refused (:func:`refuse_continuous_batching`): a paged K/V cache cannot hold the
        forget-gate cumsum and KV-shift state; ``generate_batch`` calls this first."""
        refuse_continuous_batching(self, "the running forget-gate cumsum and the KV-shift state")

    def _validate_generation_mode(self, generation_mode, *args, **kwargs) -> None:
        """``generate()`` hook: refuse assisted / prompt-lookup (speculative) decoding clearly.

        Those strategies roll the cache back over rejected draft tokens, and a
        :class:`FoTCache` cannot be cropped (the KV-shift state of earlier positions is not
        kept).
        """
        from transformers.generation.configuration_utils import GenerationMode

        if generation_mode == GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                "assisted / speculative decoding (assistant_model=..., prompt_lookup_num_tokens="
                "..., assistant_early_exit=...) is not supported by FoT models: it rolls the "
                "cache back over rejected draft tokens and FoTCache cannot be cropped. Use "
                "greedy decoding, sampling or beam search"
            )
        super()._validate_generation_mode(generation_mode, *args, **kwargs)

    @torch.no_grad()
    def per_token_loss(
        self,
        input_ids: torch.LongTensor,
        shift_labels: torch.LongTensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token loss at every position, for evaluation (no gradient).

        Args:
            input_ids: ``[B, T]`` int64.
            shift_labels: ``[B, T]`` int64 next tokens (-100 = ignore).
            cu_seqlens: ``[N + 1]`` packed documents (``B == 1``).

        Returns:
            ``[B, T]`` float32 losses in nats, 0 where ignored. The LM-head logits are computed
            in fp32 even under a bf16 autocast.
        """
        out = self.model(input_ids=input_ids, cu_seqlens=cu_seqlens, return_dict=True)
        hidden = out.last_hidden_state
        _check_labels("shift_labels", shift_labels, tuple(hidden.shape[:2]))
        return self._loss_per_token(hidden, shift_labels, fp32_logits=True)


__all__ = [
    "FoTAttention",
    "FoTDecoderLayer",
    "FoTForCausalLM",
    "FoTForgetGateProj",
    "FoTModel",
    "FoTPreTrainedModel",
    "get_attention_functions",
    "sdpa_attention",
]
