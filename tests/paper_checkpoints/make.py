"""Write the paper-code checkpoints that tests/test_convert.py converts and checks.

Each folder holds a tiny model built by the paper's own package
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

The paper's recurrent baselines (DeltaNet, HGRN2, Mamba-2: ``BASELINE_VARIANTS``) are its own
model classes on flash-linear-attention at the pinned commit 1c5937e itself (put on the path; it
runs its norms on CUDA only). Two substitutions there: the short convolutions take FLA's own
PyTorch path (``use_fast_conv1d=False``) instead of the causal-conv1d package, the same causal
convolution; and Mamba-2's gated RMSNorm, which the paper imports from the mamba-ssm package,
is ``_GatedRMSNorm`` below, written from mamba-ssm's definition (``norm_before_gate=False``:
``rmsnorm(x * silu(z)) * weight`` over groups of ``group_size``). Without mamba-ssm the paper's
Mamba-2 runs HF's PyTorch scan (``torch_forward``), which also clamps the time step at
``time_step_min`` (0.001) where mamba-ssm's path, which the paper's runs took, clamps at
``time_step_limit`` (0, inf) as FLA does: the reference cannot tell the two apart, as its time
steps stay far above 0.001 (the smallest is 0.058). HGRN2's and Mamba-2's logits are float32
(TF32 matmuls inside FLA's kernels); DeltaNet's come from float16 autocast, like the attention
variants', as the paper's ``chunk_delta_rule`` refuses float32.

Run on a GPU machine with the paper's source on the path (names: only those variants)::

    PYTHONPATH=<forgetting-transformer checkout>/src python tests/paper_checkpoints/make.py [NAME ...]
    PYTHONPATH=<flash-linear-attention at 1c5937e>:<forgetting-transformer checkout>/src \
        python tests/paper_checkpoints/make.py delta_net hgrn2 mamba2

(The attention variants fake a few ``fla`` modules, as said above, so they and the baselines
are made in separate runs.)
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


# The paper's recurrent baselines: its configs' settings at a tiny size (DeltaNet's MLP width
# left to hidden_ratio, as in the paper's runs; 2 HGRN2 heads of 32; Mamba-2 with one group and
# 32-token chunks, so that the scan crosses chunks)
BASELINE_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    fuse_cross_entropy=False,
    bos_token_id=0,
    eos_token_id=0,
    tie_word_embeddings=False,
)
BASELINE_VARIANTS = {
    "delta_net": dict(num_heads=2, norm_eps=1e-6, max_position_embeddings=256),
    "hgrn2": dict(expand_ratio=32, norm_eps=1e-6, max_position_embeddings=256),
    "mamba2": dict(
        num_heads=4, head_dim=32, state_size=16, n_groups=1, chunk_size=32, pad_token_id=None
    ),
}


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights of unit-scale effect: matrices ~ N(0, 1/fan_in) (convolution kernels
    ~ N(0, 1/width)), norm weights and other vectors ~ U(0.5, 1.5), forget-gate biases
    ~ N(2, 1) (gates between short and long memory)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim in (2, 3):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
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


class _GatedRMSNorm(torch.nn.Module):
    """mamba-ssm's gated RMSNorm (``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``) with
    ``norm_before_gate=False``: ``y = (x * silu(z)) / rms * weight``, the RMS taken over each
    group of ``group_size`` channels, in float32; output in x's dtype."""

    def __init__(self, hidden_size, eps=1e-5, norm_before_gate=False, group_size=None):
        super().__init__()
        assert not norm_before_gate
        self.eps = eps
        self.group_size = group_size or hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, z=None):
        h = x.float()
        if z is not None:
            h = h * torch.nn.functional.silu(z.float())
        g = h.unflatten(-1, (-1, self.group_size))
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + self.eps)
        return (g.flatten(-2) * self.weight.float()).to(x.dtype)


def _baseline_classes(name: str):
    """The paper's config and model classes of a recurrent baseline, served as the module
    docstring says."""
    import fla.modules.convolution as convolution

    plain_init = convolution.ShortConvolution.__init__

    def init_without_causal_conv1d(self, *args, **kwargs):
        plain_init(self, *args, **{**kwargs, "use_fast_conv1d": False})

    convolution.ShortConvolution.__init__ = init_without_causal_conv1d
    if name == "delta_net":
        from forgetting_transformer.model.delta_net import configuration_delta_net as c
        from forgetting_transformer.model.delta_net import modeling_delta_net as m

        return c.DeltaNetConfig, m.DeltaNetForCausalLM
    if name == "hgrn2":
        from forgetting_transformer.model.hgrn2 import configuration_hgrn2 as c
        from forgetting_transformer.model.hgrn2 import modeling_hgrn2 as m

        return c.HGRN2Config, m.HGRN2ForCausalLM
    from forgetting_transformer.model.mamba2 import configuration_mamba2 as c
    from forgetting_transformer.model.mamba2 import modeling_mamba2 as m

    assert m.RMSNormGated is None, "mamba-ssm is installed: its kernels would run instead"
    m.RMSNormGated = _GatedRMSNorm
    return c.Mamba2Config, m.Mamba2ForCausalLM


def main() -> None:
    from forgetting_transformer.model.forgetting_transformer.configuration_forgetting_transformer import (
        ForgettingTransformerConfig,
    )
    from forgetting_transformer.model.forgetting_transformer.modeling_forgetting_transformer import (
        ForgettingTransformerForCausalLM,
    )

    names = sys.argv[1:] or [*VARIANTS, *TRANSFORMER_VARIANTS]
    baselines = [name for name in names if name in BASELINE_VARIANTS]
    if baselines and len(baselines) < len(names):
        sys.exit("make the baselines and the attention variants in separate runs (docstring)")
    for name in names:
        gen = torch.Generator().manual_seed(0)
        if name in BASELINE_VARIANTS:
            config_class, model_class = _baseline_classes(name)
            config = config_class(**BASELINE_COMMON, **BASELINE_VARIANTS[name])
        elif name in TRANSFORMER_VARIANTS:
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
        if name in BASELINE_VARIANTS and name != "delta_net":
            with torch.no_grad():
                logits = model(input_ids=ids.cuda(), use_cache=False).logits.float().cpu()
        else:
            # the paper's attention kernel takes 16-bit q/k/v only: float16 autocast, the closer
            # of the two to float32 (10 mantissa bits), as its evaluation runs under autocast
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
