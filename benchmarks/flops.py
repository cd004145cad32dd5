"""Training FLOPs per token of every benchmarked model, through the trainer's one formula.

The formula lives in :func:`fot.training.metrics.flops_per_token` (the trainer logs MFU with it);
this module only tells it where the softmax attention is in configs that it does not know
(HF ``LlamaForCausalLM``, FLA's ``ForgettingTransformerForCausalLM``), so that every model in a
benchmark is counted the same way:

    FLOPs/token = 6 * N  +  12 * L_attn * d_attn * T_eff

* ``N``: every parameter except the input embedding. It includes the LM head (tied to the
  input embedding or not: its matmul costs the same), so ``6 * N = 6 * N_blocks + 6 * d * V`` (forward 2, backward 4 FLOPs per weight and token; the
  embedding lookup costs no matmul FLOPs).
* ``12 * L_attn * d_attn * T_eff``: ``q k^T`` and ``p v`` are ``2 * 2 * d_attn`` FLOPs per
  (query, key) pair in the forward, times 3 with the backward, over the average causal context
  ``T_eff = (T + 1) / 2`` (with a sliding window of ``W`` keys, the pairs
  ``W (W + 1) / 2 + (T - W) W`` over ``T``). ``d_attn`` is ``num_heads * head_dim`` and
  ``L_attn`` the number of softmax-attention layers.

Example (760M, T = 16384): N = 757.7M (FoT LLaMA) gives 6N = 4.55 GFLOP and the attention term
12 * 24 * 1536 * 8192.5 = 3.62 GFLOP, 8.17 GFLOP per token in all.

As a script it prints that split for the benchmarked models (built on the meta device, no
weights allocated):

    python benchmarks/flops.py --size 760m --seq-len 16384 --models fot_llama,hf_llama
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from fot.training.metrics import flops_per_token

# model_type of HF configs whose every layer is softmax attention, beside fot's own "fot"
_ATTENTION_MODEL_TYPES = ("fot", "llama", "forgetting_transformer")


def attention_spec(config: Any) -> tuple[int, int, int | None]:
    """Where the softmax attention is: ``(layers, d_attn = heads * head_dim, window)``.

    Args:
        config: an HF config (``FoTConfig``, ``LlamaConfig``, FLA ``ForgettingTransformerConfig``;
            other model types give no layers here, and :func:`train_flops_per_token` counts
            them as the trainer does: FLA's Samba by its ``attn`` layers, the recurrent
            models without attention).

    Returns:
        Number of attention layers, attention width and sliding window (``None`` = full).
    """
    if getattr(config, "model_type", None) not in _ATTENTION_MODEL_TYPES:
        return 0, 0, None
    heads = getattr(config, "num_attention_heads", None) or config.num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "window_size", None) or getattr(config, "sliding_window", None)
    return int(config.num_hidden_layers), int(heads * head_dim), window


def train_flops_per_token(model: nn.Module, config: Any, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of ``model`` at sequence length ``seq_len``.

    Calls :func:`fot.training.metrics.flops_per_token` (see the module docstring for the
    formula) with the attention layers of :func:`attention_spec`.

    Args:
        model: the unwrapped causal LM (``get_input_embeddings()`` must work; meta device is fine).
        config: its HF config.
        seq_len: training sequence length T.
    """
    layers, d_attn, window = attention_spec(config)
    if not layers:  # no all-attention config: the trainer's count as is (Samba's ``attn``)
        return flops_per_token(model, config, seq_len)
    view = SimpleNamespace(
        model_type="fot",
        num_hidden_layers=layers,
        hidden_size=d_attn,
        window_size=window,
    )
    return flops_per_token(model, view, seq_len)


def flops_breakdown(model: nn.Module, config: Any, seq_len: int) -> dict[str, float]:
    """Per-token training FLOPs split into ``blocks``, ``lm_head`` and ``attention`` (and ``total``).

    ``blocks`` is ``6 *`` the parameters that are neither the input embedding nor the LM head.
    """
    total = train_flops_per_token(model, config, seq_len)
    head = model.get_output_embeddings()
    n_head = 0 if head is None else head.weight.numel()  # in N, tied or not
    skip = {id(model.get_input_embeddings().weight)} | ({id(head.weight)} if head else set())
    n_blocks = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return {
        "blocks": 6.0 * n_blocks,
        "lm_head": 6.0 * n_head,
        "attention": total - 6.0 * (n_blocks + n_head),
        "total": total,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print FLOPs per token (GFLOP) of each ``--models`` entry; returns ``{model: breakdown}``."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # train_throughput.py, a sibling script
        sys.path.insert(0, here)
    from train_throughput import ALL_MODELS, build, parse_models

    from fot import presets

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="fot_llama,hf_llama", help=f"of {','.join(ALL_MODELS)}")
    p.add_argument("--size", default="760m", choices=presets.SIZES)
    p.add_argument("--seq-len", type=int, default=16384, help="training sequence length T")
    args = p.parse_args(argv)
    models = parse_models(args.models, ALL_MODELS)
    if args.seq_len < 1:
        p.error(f"--seq-len must be >= 1, got {args.seq_len}")
    print(f"Training GFLOP per token, size {args.size}, T = {args.seq_len}:\n")
    print(
        "| model | N (no emb.) | 6N blocks | 6N LM head | attention | total |\n" + "|---" * 6 + "|"
    )
    out = {}
    for name in models:
        model, config, _ = build(name, args.size, device=torch.device("meta"), seq_len=args.seq_len)
        parts = out[name] = flops_breakdown(model, config, args.seq_len)
        n = (parts["blocks"] + parts["lm_head"]) / 6
        cols = [f"{parts[k] / 1e9:.3f}" for k in ("blocks", "lm_head", "attention", "total")]
        print(f"| {name} | {n / 1e6:.1f}M | " + " | ".join(cols) + " |")
    return out


__all__ = ["attention_spec", "flops_breakdown", "main", "train_flops_per_token"]

if __name__ == "__main__":
    main()
