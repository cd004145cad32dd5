"""Write the paper-code checkpoints that tests/test_convert.py converts and checks.

Each folder holds a tiny FoX or Transformer model built by the paper's own package
(zhixuan-lin/forgetting-transformer, ``forgetting_transformer``; fot does not install it),
saved with its ``save_pretrained``'s files (``config.json``, ``model.safetensors``), and
``reference.npz``: input ids and the logits that the paper's model computes for them. The
paper's kernels need a CUDA GPU (Triton) and take 16-bit q/k/v: the logits come from float16
autocast. Weights are drawn large enough (not the paper's init scale) that every component
moves the logits by O(1): a wrong mapping shows.

The paper's ``TransformerForCausalLM`` (Transformer (LLaMA), sliding window, GQA) imports its
norm, SwiGLU and rotary modules from flash-linear-attention at the commit the paper pins
(1c5937e), and its attention from the flash-attn package. Neither is installed here: the
first three are given the paper package's own copies of those modules (the same code, kept
in ``forgetting_transformer.model.forgetting_transformer``), and ``flash_attn_func`` a causal
(sliding-window) attention in float32 through SDPA, which is what flash-attn computes.

Run on a GPU machine with the paper's source on the path (names: only those variants)::

    PYTHONPATH=<forgetting-transformer checkout>/src python tests/paper_checkpoints/make.py [NAME ...]
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_heads=2,
    norm_eps=1e-6,
    max_position_embeddings=256,
    fuse_cross_entropy=False,
    bos_token_id=0,
    eos_token_id=0,
)
PRO = dict(
    use_output_gate=True,
    use_output_norm=True,
    qk_norm=True,
    use_k_shift=True,
    use_v_shift=True,
)
# FoX-type variants: the paper's ForgettingTransformerForCausalLM
VARIANTS = {
    # FoX (Pro): every Pro component, q/k norm weights per head (the released code's default)
    "fox_pro": dict(
        use_output_gate=True,
        use_output_norm=True,
        qk_norm=True,
        use_k_shift=True,
        use_v_shift=True,
    ),
    # the same with one q/k norm weight shared by the heads (what the paper's own runs used)
    "fox_pro_shared_qk_norm": dict(
        use_output_gate=True,
        use_output_norm=True,
        qk_norm=True,
        qk_norm_share_param_across_head=True,
        use_k_shift=True,
        use_v_shift=True,
    ),
    # FoX (LLaMA): RoPE, no Pro component
    "fox_llama": dict(use_rope=True, rope_base=10000.0),
    # Transformer (Pro): the paper builds it as FoX without forget gate, with RoPE
    "transformer_pro": dict(fgate_type="none", use_rope=True, rope_base=10000.0, **PRO),
    # the gate ablations: one learned bias per head; fixed per-head decay (a buffer)
    "fox_llama_bias_only": dict(fgate_type="bias_only", use_rope=True, rope_base=10000.0),
    "fox_pro_fixed": dict(
        fgate_type="fixed", fgate_bias_init=True, decay_time_min=2.0, decay_time_max=64.0, **PRO
    ),
}
# Transformer-type variants: the paper's TransformerForCausalLM (RoPE on by default)
TRANSFORMER_VARIANTS = {
    "transformer_llama": dict(rope_base=10000.0),  # Transformer (LLaMA)
    "transformer_swa": dict(rope_base=10000.0, window_size=16),  # a window of 16 of 77 tokens
    "transformer_gqa": dict(rope_base=10000.0, num_kv_heads=1),  # 2 query heads per k/v head
}


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights of unit-scale effect: matrices ~ N(0, 1/fan_in), norm weights ~ U(0.5, 1.5),
    forget-gate biases ~ N(2, 1) (gates between short and long memory)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif "fgate" in name:
                p.copy_(2.0 + torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))


def _flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), **unused):
    """flash-attn's ``flash_attn_func`` for [B, T, H, D] inputs with as many k/v heads as q
    heads: keys ``i - left <= j <= i + right`` of ``window_size=(left, right)`` (-1: no limit),
    causal, scale 1/sqrt(D); float32 softmax, output in q's dtype."""
    assert causal and not unused, (causal, unused)
    t = q.shape[1]
    i = torch.arange(t, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if window_size[0] >= 0:
        allowed &= i[None, :] >= i[:, None] - window_size[0]
    with torch.autocast("cuda", enabled=False):
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2).float() for x in (q, k, v)), attn_mask=allowed
        )
    return o.transpose(1, 2).to(q.dtype)


def _transformer_classes():
    """The paper's TransformerConfig and TransformerForCausalLM, its FLA and flash-attn imports
    served as the module docstring says."""
    from forgetting_transformer.model.forgetting_transformer import (
        fused_cross_entropy,
        glu_linear,
        layernorm,
        rotary,
    )

    def unavailable(*args, **kwargs):
        raise NotImplementedError("padded inputs are not used here")

    fla = types.ModuleType("fla")
    fla.modules = types.ModuleType("fla.modules")
    fla.modules.RMSNorm = layernorm.RMSNorm
    fla.modules.RotaryEmbedding = rotary.RotaryEmbedding
    fla.modules.FusedCrossEntropyLoss = fused_cross_entropy.FusedCrossEntropyLoss
    fla.modules.activations = types.ModuleType("fla.modules.activations")
    fla.modules.activations.swiglu_linear = glu_linear.swiglu_linear
    flash_attn = types.ModuleType("flash_attn")
    flash_attn.flash_attn_func = _flash_attn_func
    flash_attn.flash_attn_varlen_func = unavailable
    flash_attn.bert_padding = types.ModuleType("flash_attn.bert_padding")
    for name in ("index_first_axis", "pad_input", "unpad_input"):
        setattr(flash_attn.bert_padding, name, unavailable)
    for module in (fla, fla.modules, fla.modules.activations, flash_attn, flash_attn.bert_padding):
        sys.modules[module.__name__] = module
    from forgetting_transformer.model.transformer.configuration_transformer import (
        TransformerConfig,
    )
    from forgetting_transformer.model.transformer.modeling_transformer import (
        TransformerForCausalLM,
    )

    return TransformerConfig, TransformerForCausalLM


def main() -> None:
    from forgetting_transformer.model.forgetting_transformer.configuration_forgetting_transformer import (
        ForgettingTransformerConfig,
    )
    from forgetting_transformer.model.forgetting_transformer.modeling_forgetting_transformer import (
        ForgettingTransformerForCausalLM,
    )

    names = sys.argv[1:] or [*VARIANTS, *TRANSFORMER_VARIANTS]
    for name in names:
        gen = torch.Generator().manual_seed(0)
        if name in TRANSFORMER_VARIANTS:
            config_class, model_class = _transformer_classes()
            config = config_class(**COMMON, **TRANSFORMER_VARIANTS[name])
        else:
            config_class, model_class = (
                ForgettingTransformerConfig,
                ForgettingTransformerForCausalLM,
            )
            config = config_class(**COMMON, **VARIANTS[name])
        model = model_class(config)
        _randomize(model, gen)
        model = model.cuda().eval()
        ids = torch.randint(0, COMMON["vocab_size"], (2, 77), generator=gen)
        # the paper's attention kernel takes 16-bit q/k/v only: float16 autocast, the closer
        # of the two to float32 (10 mantissa bits), as the paper's evaluation runs under autocast
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            logits = model(input_ids=ids.cuda(), use_cache=False).logits.float().cpu()
        out = HERE / name
        out.mkdir(exist_ok=True)
        # as save_pretrained writes them (its transformers-5 version fails on this model's
        # _tied_weights_keys, and so does building it with tied embeddings)
        config.save_pretrained(out)
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        np.savez(out / "reference.npz", input_ids=ids.numpy(), logits=logits.numpy())
        print(name, tuple(logits.shape), float(logits.abs().mean()), float(logits.std()))


if __name__ == "__main__":
    main()
