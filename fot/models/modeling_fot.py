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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .cache import FoTCache, FoTLayerCache
from .configuration_fot import FoTConfig

IGNORE_INDEX = -100

# ---------------------------------------------------------------------------------------
# Attention backends: chosen by name, one signature each for full attention and decode.
# ---------------------------------------------------------------------------------------


def get_attention_functions(backend: str, device: torch.device) -> tuple[Callable, Callable]:
    """Return ``(attention, decode_attention)`` for a backend name.

    Args:
        backend: ``"auto"`` (Triton on CUDA tensors, reference elsewhere), ``"triton"`` or
            ``"reference"``.
        device: device of the query tensor (decides ``"auto"``).

    Returns:
        Two callables with the signatures of ``fot.kernels.forgetting_attention_reference`` and
        ``fot.kernels.forgetting_attention_decode_reference``.
    """
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        from fot.kernels.reference import (
            forgetting_attention_decode_reference,
            forgetting_attention_reference,
        )

        return forgetting_attention_reference, forgetting_attention_decode_reference
    if backend not in ("auto", "triton"):
        raise ValueError(
            f"unknown attn_backend {backend!r}; valid: ['auto', 'triton', 'reference']"
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


# ---------------------------------------------------------------------------------------
# Small layers
# ---------------------------------------------------------------------------------------


class FoTRMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32: ``x / rms(x) * weight``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # Scale in fp32, then return the input's dtype: under bf16 autocast an fp32 weight
        # times a bf16 tensor would promote q/k to fp32 while v stays bf16.
        return (self.weight * x).to(dtype)


class FoTHeadRMSNorm(nn.Module):
    """Per-head RMSNorm with per-head weights: ``[..., H, D]`` normalised over ``D``.

    Used for QK-norm and the output norm of FoT (Pro); weight ``[H, D]`` (one scale vector per
    head, not shared across heads).
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # Scale in fp32, then return the input's dtype: under bf16 autocast an fp32 weight
        # times a bf16 tensor would promote q/k to fp32 while v stays bf16.
        return (self.weight * x).to(dtype)


class FoTMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: FoTConfig) -> None:
        super().__init__()
        width = config.mlp_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
    q_out = q.float() * cos + rotate_half(q.float()) * sin
    k_out = k.float() * cos + rotate_half(k.float()) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def long_init_bias(num_heads: int, t_min: float, t_max: float) -> torch.Tensor:
    """Forget-gate biases whose decay times ``1 / (-log sigmoid(b))`` are log-uniform in
    ``[t_min, t_max]`` across heads ("long-init", paper App. B).

    Returns:
        ``[num_heads]`` float32.
    """
    decay_time = torch.exp(
        torch.linspace(math.log(t_min), math.log(t_max), num_heads, dtype=torch.float64)
    )
    # -log sigmoid(b) = 1/T  <=>  sigmoid(b) = exp(-1/T)  <=>  b = -log(expm1(1/T))
    return (-torch.log(torch.expm1(1.0 / decay_time))).float()


def token_shift(
    x: torch.Tensor,
    shift_logits: torch.Tensor,
    prev: torch.Tensor | None,
    reset: torch.Tensor | None,
) -> torch.Tensor:
    """Data-dependent token shift ``y_t = a_t * x_{t-1} + (1 - a_t) * x_t``, ``a = sigmoid``.

    Args:
        x: ``[B, T, H, D]`` pre-shift projections (already zero at padding positions).
        shift_logits: ``[B, T, H]`` logits of ``a_t`` (one mixing weight per head and step).
        prev: ``[B, H, D]`` the projection of the token before ``x[:, 0]`` (cache), or None
            (sequence start: ``x_{-1} = 0``).
        reset: ``[T]`` bool, True where a new document starts (``x_{t-1}`` treated as 0).

    Returns:
        ``[B, T, H, D]`` in x's dtype (mixing in fp32).
    """
    first = torch.zeros_like(x[:, :1]) if prev is None else prev[:, None].to(x.dtype)
    x_prev = torch.cat([first, x[:, :-1]], dim=1)  # (B, T, H, D)
    if reset is not None:
        x_prev = x_prev.masked_fill(reset[None, :, None, None], 0.0)
    a = torch.sigmoid(shift_logits.float())[..., None]  # (B, T, H, 1)
    return (a * x_prev.float() + (1.0 - a) * x.float()).to(x.dtype)


@dataclass
class _Context:
    """Per-forward information shared by all layers (built once in :class:`FoTModel`)."""

    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin (B, T, 1, D); None = no RoPE
    cu_seqlens: torch.Tensor | None  # (N + 1,) packed documents (B == 1)
    doc_starts: torch.Tensor | None  # (T,) bool, True at document starts (KV-shift reset)
    key_mask: torch.Tensor | None  # (B, Tk) bool over cached + new keys; None = all valid
    query_mask: torch.Tensor | None  # (B, T) bool over the new positions; None = all valid


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------


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
            self.fgate_proj = nn.Linear(hidden, hq, bias=True)
        elif self.fgate_type == "bias_only":
            self.fgate_bias = nn.Parameter(
                long_init_bias(hq, config.decay_time_min, config.decay_time_max)
            )
        elif self.fgate_type == "fixed":
            # A buffer, not a Parameter: never trained (ALiBi-like fixed linear decay per head).
            self.register_buffer(
                "fgate_bias", long_init_bias(hq, config.decay_time_min, config.decay_time_max)
            )

        if config.use_k_shift:
            self.k_shift_proj = nn.Linear(hidden, hkv, bias=False)
        if config.use_v_shift:
            self.v_shift_proj = nn.Linear(hidden, hkv, bias=False)
        if config.qk_norm:
            self.q_norm = FoTHeadRMSNorm(hq, d, config.norm_eps)
            self.k_norm = FoTHeadRMSNorm(hkv, d, config.norm_eps)
        if config.use_output_norm:
            self.o_norm = FoTHeadRMSNorm(hq, d, config.norm_eps)
        if config.use_output_gate:
            self.g_proj = nn.Linear(hidden, hq * d, bias=False)

    def log_fgate(self, x: torch.Tensor) -> torch.Tensor:
        """Log forget gate ``[B, T, HQ]`` float32 for hidden states ``x`` ``[B, T, hidden]``."""
        B, T, _ = x.shape
        if self.fgate_type == "full":
            # The gate logits are computed in fp32 (tiny: HQ outputs), never in bf16, also
            # under autocast (which would otherwise run this matmul in bf16).
            w, b = self.fgate_proj.weight, self.fgate_proj.bias
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), w.float(), b.float())  # (B, T, HQ)
            return F.logsigmoid(logits)
        if self.fgate_type in ("bias_only", "fixed"):
            return F.logsigmoid(self.fgate_bias.float()).expand(B, T, self.num_heads)
        return x.new_zeros(B, T, self.num_heads, dtype=torch.float32)  # "none": f = 1

    def forward(
        self,
        x: torch.Tensor,
        ctx: _Context,
        cache: FoTLayerCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, hq, d)  # (B, T, HQ, D)
        k = self.k_proj(x).view(B, T, hkv, d)  # (B, T, H, D)
        v = self.v_proj(x).view(B, T, hkv, d)  # (B, T, H, D)
        if ctx.query_mask is not None:
            # Padding contributes nothing to the KV-shift of the next real token.
            keep = ctx.query_mask[:, :, None, None]
            k, v = k * keep, v * keep

        # KV-shift mixes each token's k/v with the previous token's (pre-shift) k/v.
        k_pre, v_pre = k, v
        if self.config.use_k_shift:
            prev = cache.k_shift if cache is not None else None
            k = token_shift(k_pre, self.k_shift_proj(x), prev, ctx.doc_starts)
        if self.config.use_v_shift:
            prev = cache.v_shift if cache is not None else None
            v = token_shift(v_pre, self.v_shift_proj(x), prev, ctx.doc_starts)

        if self.config.qk_norm:  # after the shift: k_t = RMSNorm(shifted k)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.config.use_rope:
            q, k = apply_rope(q, k, *ctx.rope)

        log_f = self.log_fgate(x)  # (B, T, HQ) float32
        if ctx.query_mask is not None:
            log_f = log_f * ctx.query_mask[:, :, None]

        attn, decode = get_attention_functions(self.config.attn_backend, q.device)
        scale, window = d**-0.5, self.config.window_size
        past = cache.seq_length if cache is not None else 0
        if cache is not None:
            c_q = cache.append(
                k,
                v,
                log_f,
                k_pre if self.config.use_k_shift else None,
                v_pre if self.config.use_v_shift else None,
            )  # (B, T, HQ)
        if past == 0 and ctx.key_mask is None:
            # Whole sequences (training, evaluation, first prefill): the flash-style kernel.
            o = attn(q, k, v, log_f, scale=scale, cu_seqlens=ctx.cu_seqlens, window_size=window)
        else:
            # Cached keys or padding: the decode function takes the running gate cumsum c of
            # the queries and of all keys, and a key mask.
            if cache is None:
                c_q = torch.cumsum(log_f.double(), dim=1).float()
                keys, values, c_k = k, v, c_q
            else:
                keys, values, c_k = cache.keys, cache.values, cache.cumsum
            o = decode(
                q, keys, values, c_q, c_k, scale=scale, window_size=window, key_mask=ctx.key_mask
            )  # (B, T, HQ, D)

        # o: (B, T, HQ, D)
        if self.config.use_output_norm:
            o = self.o_norm(o)
        if self.config.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x)).view(B, T, hq, d)
        return self.o_proj(o.reshape(B, T, hq * d))


class FoTDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: FoTConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = FoTRMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = FoTAttention(config, layer_idx)
        self.post_attention_layernorm = FoTRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = FoTMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        ctx: _Context,
        past_key_values: FoTCache | None = None,
    ) -> torch.Tensor:
        cache = past_key_values[self.self_attn.layer_idx] if past_key_values is not None else None
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), ctx, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------------------------------
# HF model classes
# ---------------------------------------------------------------------------------------


class FoTPreTrainedModel(PreTrainedModel):
    """Weights init (N(0, initializer_range), paper App. E.11) and HF plumbing."""

    config_class = FoTConfig
    config: FoTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["FoTDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["past_key_values"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
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
    ) -> _Context:
        key_mask = query_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape != (B, past + T):
                raise ValueError(
                    f"attention_mask must be [B, past + T] = {(B, past + T)} (1 = token, 0 = "
                    f"padding), got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.to(device=device, dtype=torch.bool)
            if not bool(mask.all()):
                key_mask, query_mask = mask, mask[:, past:]
        doc_starts = None
        positions = None
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens (packed documents) needs batch size 1, got B={B}")
            if past:
                raise ValueError("cu_seqlens cannot be combined with a non-empty cache")
            if key_mask is not None:
                raise ValueError("cu_seqlens cannot be combined with padding in attention_mask")
            cu = cu_seqlens.to(device=device, dtype=torch.long)
            if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != T:
                raise ValueError(
                    f"cu_seqlens must be 1-D, start at 0 and end at T={T}, got "
                    f"{cu_seqlens.tolist()[:8]}"
                )
            t = torch.arange(T, device=device)
            doc = torch.searchsorted(cu[1:], t, right=True)  # (T,) document of each position
            doc_starts = torch.zeros(T, dtype=torch.bool, device=device)
            starts = cu[:-1]
            doc_starts[starts[starts < T]] = True  # (empty documents at the end start at T)
            positions = (t - cu[doc])[None]  # (1, T)
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
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Hidden states of the last layer (after the final norm).

        Args:
            input_ids: ``[B, T]`` int64 token ids (or ``inputs_embeds`` ``[B, T, hidden]``).
            attention_mask: ``[B, past + T]`` 1 for tokens, 0 for padding (left padding in
                generation); ``None`` = no padding.
            past_key_values: a :class:`FoTCache` from a previous call.
            use_cache: return a (new or updated) :class:`FoTCache`. Default False.
            cu_seqlens: ``[N + 1]`` cumulative document lengths (packed documents, ``B == 1``):
                attention, gate cumsum, KV-shift and RoPE positions restart per document.

        Returns:
            ``BaseModelOutputWithPast`` with ``last_hidden_state`` ``[B, T, hidden]``.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, hidden)
        B, T, _ = inputs_embeds.shape
        if use_cache and past_key_values is None:
            past_key_values = FoTCache(self.config.num_hidden_layers)
        if past_key_values is not None and not isinstance(past_key_values, FoTCache):
            raise TypeError(
                f"past_key_values must be a FoTCache (returned by a previous forward with "
                f"use_cache=True), got {type(past_key_values).__name__}"
            )
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        ctx = self._context(B, T, inputs_embeds.device, attention_mask, cu_seqlens, past)
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, ctx, past_key_values=past_key_values)
        h = self.norm(h)
        return BaseModelOutputWithPast(last_hidden_state=h, past_key_values=past_key_values)


def _chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    fp32_logits: bool = False,
) -> torch.Tensor:
    """Per-row cross-entropy of ``hidden @ weight.T`` without materialising all logits.

    Args:
        hidden: ``[N, hidden]``; weight: ``[V, hidden]``; labels: ``[N]`` int64 (-100 = ignore).
        chunk_size: rows whose fp32 logits exist at once; under autograd each chunk is
            checkpointed, so backward also holds one chunk's logits at a time.
        fp32_logits: compute the logits in fp32 with autocast off (evaluation); otherwise in
            the autocast/model dtype, then upcast for the softmax (training).

    Returns:
        ``[N]`` float32 losses, 0 at ignored rows.
    """

    def _rows(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if fp32_logits:  # evaluation: exact logits even under a bf16 autocast
            with torch.autocast(h.device.type, enabled=False):
                logits = F.linear(h.float(), weight.float())  # (n, V)
        else:
            logits = F.linear(h, weight).float()  # (n, V)
        return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="none")

    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    out = []
    for s in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[s : s + chunk_size], labels[s : s + chunk_size]
        out.append(checkpoint(_rows, h, y, use_reentrant=False) if grad else _rows(h, y))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def _fla_fused_linear_ce() -> type | None:
    """FLA's fused linear cross-entropy class, or None where FLA is not installed."""
    try:
        from fla.modules import FusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return FusedLinearCrossEntropyLoss


class FoTForCausalLM(FoTPreTrainedModel, GenerationMixin):
    """FoT / Transformer language model with an untied, vocab-padded LM head.

    ``forward`` returns ``CausalLMOutputWithPast``. When a loss is requested (``labels`` or
    ``shift_labels``) the ``[T, V]`` logits are never materialised in fp32 as a whole (FLA fused
    linear cross-entropy on CUDA, chunked cross-entropy elsewhere) and ``.logits`` is ``None``.
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

    def _loss_per_token(
        self, hidden: torch.Tensor, shift_labels: torch.Tensor, fp32_logits: bool = False
    ) -> torch.Tensor:
        """``[B, T]`` float32 next-token losses (0 where ``shift_labels == -100``)."""
        B, T, H = hidden.shape
        if shift_labels.shape != (B, T):
            raise ValueError(
                f"shift_labels must be [B, T] = {(B, T)} like input_ids, got "
                f"{tuple(shift_labels.shape)}"
            )
        labels = shift_labels.to(hidden.device).reshape(-1).long()
        losses = _chunked_cross_entropy(
            hidden.reshape(B * T, H),
            self._head_weight,
            labels,
            self.config.loss_chunk_size,
            fp32_logits=fp32_logits,
        )
        return losses.view(B, T)

    def _mean_loss(self, hidden: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        impl = self.config.loss_impl
        fused = (
            _fla_fused_linear_ce() if impl == "fla" or (impl == "auto" and hidden.is_cuda) else None
        )
        if impl == "fla" and fused is None:
            raise ImportError(
                "loss_impl='fla' needs flash-linear-attention (fla.modules."
                "FusedLinearCrossEntropyLoss); install it or use loss_impl='chunked'"
            )
        if fused is not None:
            B, T, H = hidden.shape
            labels = shift_labels.to(hidden.device).reshape(-1).long()
            # Sum, then divide on device: no host sync, and an all-ignored batch gives 0.
            fn = fused(ignore_index=IGNORE_INDEX, reduction="sum")
            total = fn(hidden.reshape(B * T, H), labels, self._head_weight)
            return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
        losses = self._loss_per_token(hidden, shift_labels)
        count = (shift_labels != IGNORE_INDEX).sum().clamp(min=1)
        return losses.sum() / count

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_key_values: FoTCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Language-model forward.

        Args:
            input_ids: ``[B, T]`` int64.
            attention_mask: ``[B, past + T]`` (1 = token, 0 = padding) or None.
            labels: ``[B, T]`` HF-style labels (shifted inside: position t predicts labels[t+1]).
            shift_labels: ``[B, T]`` next-token labels (-100 = ignore); takes precedence over
                ``labels``.
            cu_seqlens: ``[N + 1]`` packed document boundaries (``B == 1``).
            past_key_values: :class:`FoTCache` from a previous call.
            use_cache: return the cache (default False; ``generate()`` sets it).
            logits_to_keep: if > 0, logits only for the last ``logits_to_keep`` positions.

        Returns:
            ``CausalLMOutputWithPast``: ``loss`` (mean over non-ignored positions) when labels
            are given, else ``logits`` ``[B, T, vocab_size]`` float32 (``None`` with a loss),
            and ``past_key_values`` when caching.
        """
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
        )
        hidden = out.last_hidden_state  # (B, T, hidden)
        if shift_labels is None and labels is not None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        loss = logits = None
        if shift_labels is not None:
            loss = self._mean_loss(hidden, shift_labels)
        else:
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            logits = F.linear(hidden, self._head_weight).float()  # (B, T, V)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, *args, **kwargs
    ) -> None:
        """``generate()`` hook: start with an empty :class:`FoTCache` (HF's default caches hold
        K and V only), so that chunked prefill (``prefill_chunk_size``) works too."""
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            model_kwargs["past_key_values"] = FoTCache(self.config.num_hidden_layers)
            return
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

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
        hidden = self.model(input_ids=input_ids, cu_seqlens=cu_seqlens).last_hidden_state
        return self._loss_per_token(hidden, shift_labels, fp32_logits=True)


__all__ = [
    "FoTAttention",
    "FoTDecoderLayer",
    "FoTForCausalLM",
    "FoTModel",
    "FoTPreTrainedModel",
    "get_attention_functions",
]
