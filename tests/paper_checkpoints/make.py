"""Write the paper-code checkpoints that tests/test_convert.py converts and checks.

Each folder holds a tiny FoX model built by the paper's own package (zhixuan-lin/forgetting-
transformer, ``forgetting_transformer``; fot does not install it), saved with its
``save_pretrained``'s files (``config.json``, ``model.safetensors``), and ``reference.npz``: input ids
and the logits that the paper's model computes for them. The paper's kernels need a CUDA GPU
(Triton) and take 16-bit q/k/v: the logits come from float16 autocast. Weights are drawn large enough (not the paper's init scale) that every component
moves the logits by O(1): a wrong mapping shows.

Run on a GPU machine with the paper's source on the path::

    PYTHONPATH=<forgetting-transformer checkout>/src python tests/paper_checkpoints/make.py
"""

from __future__ import annotations

import math
import sys
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


def main() -> None:
    from forgetting_transformer.model.forgetting_transformer.configuration_forgetting_transformer import (
        ForgettingTransformerConfig,
    )
    from forgetting_transformer.model.forgetting_transformer.modeling_forgetting_transformer import (
        ForgettingTransformerForCausalLM,
    )

    names = sys.argv[1:] or list(VARIANTS)
    for name in names:
        gen = torch.Generator().manual_seed(0)
        config = ForgettingTransformerConfig(**COMMON, **VARIANTS[name])
        model = ForgettingTransformerForCausalLM(config)
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
