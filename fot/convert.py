"""Checkpoints of the paper's code (zhixuan-lin/forgetting-transformer) as fot models.

The paper released its 760M LongCrawl64 models (FoX (Pro), FoX (LLaMA), Transformer (Pro),
Transformer (LLaMA), ...) as Hugging Face folders of its own model types, which load only with
its package installed: ``forgetting_transformer-project_fox`` (FoX, and Transformer (Pro),
which is FoX with ``fgate_type="none"``) and ``transformer-project_fox`` (Transformer (LLaMA)
and the sliding-window Transformer). :func:`from_paper` reads such a folder (config and
weights, no code of the paper's package needed) into a :class:`fot.FoTForCausalLM` that
computes the same function; ``python -m fot.convert SRC OUT`` writes it as a fot export, which
``fot.eval`` and ``AutoModelForCausalLM`` (after ``import fot``) load like any other. The
paper's recurrent baselines (Mamba-2, HGRN2, DeltaNet, Samba) are other model types and are
refused.

The weights map one to one, renamed: the paper's fused MLP input projection is split into
fot's gate and up projections, its shift projections (``k_proj.shift_proj``) become
``k_shift_proj``, one q/k-norm weight shared by the heads is repeated per head, a tied LM head
becomes a copy of the embedding, and the embedding and LM head get fot's padded vocabulary
rows (zeros; their logits are cut off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fot.errors import FotError, parse_args_naming_typos

PAPER_MODEL_TYPE = "forgetting_transformer-project_fox"
"""``model_type`` in the config.json of the paper's FoX (and Transformer (Pro)) checkpoints."""

PAPER_TRANSFORMER_MODEL_TYPE = "transformer-project_fox"
"""``model_type`` in the config.json of the paper's Transformer (LLaMA) and sliding-window
Transformer checkpoints (its ``TransformerForCausalLM``: RoPE, no forget gate, GQA)."""

PAPER_MODEL_TYPES = (PAPER_MODEL_TYPE, PAPER_TRANSFORMER_MODEL_TYPE)
"""The paper's model types that convert."""


class PaperCheckpointError(FotError, ValueError):
    """A folder that is not a FoX checkpoint of the paper's code, or one fot cannot express."""


def paper_intermediate_size(cfg: Mapping[str, Any]) -> int:
    """The MLP width the paper's code builds: ``intermediate_size``, else ``hidden_ratio``
    (default 4) x hidden x 2/3 rounded up to a multiple of 256."""
    if cfg.get("intermediate_size") is not None:
        return int(cfg["intermediate_size"])
    ratio = cfg.get("hidden_ratio") or 4
    width = int(cfg["hidden_size"] * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)


def fot_config_from_paper(cfg: Mapping[str, Any]) -> Any:
    """The :class:`fot.FoTConfig` of a paper FoX or Transformer config (a ``config.json`` dict).

    The paper's ``TransformerForCausalLM`` (``transformer-project_fox``) is fot's block without
    forget gate or Pro components, with RoPE on by default, and the only one of the paper's
    models with grouped-query attention (``num_kv_heads``) and a sliding window
    (``window_size``); its FoX reads neither.

    Raises:
        PaperCheckpointError: another model type, or a setting fot has no counterpart for
            (the message names it).
    """
    from fot.models import FoTConfig
    from fot.tokenizer import EOT_ID

    if not isinstance(cfg, Mapping):
        raise PaperCheckpointError(
            f"config.json holds a {type(cfg).__name__}, not an object of settings: it is not a "
            "checkpoint's config.json"
        )
    model_type = cfg.get("model_type")
    if model_type not in PAPER_MODEL_TYPES:
        raise PaperCheckpointError(
            f"config.json has model_type {model_type!r}, not one of the paper's attention "
            f"models {PAPER_MODEL_TYPE!r} (FoX, Transformer (Pro)) or "
            f"{PAPER_TRANSFORMER_MODEL_TYPE!r} (Transformer (LLaMA), sliding window): only "
            "those convert (the paper's recurrent baselines are FLA models of other types)"
        )
    transformer = model_type == PAPER_TRANSFORMER_MODEL_TYPE
    # attention_bias and elementwise_affine are in the paper's config but no FoX module reads
    # them (projections without bias, norms with weights): they convert whatever they say. Its
    # Transformer's MLP is SwiGLU whatever hidden_act says, and it has no output gate.
    unsupported = {
        "hidden_act": (cfg.get("hidden_act", "swish"), "swish"),
        "ogate_act": (cfg.get("ogate_act", "sigmoid"), "sigmoid"),
    }
    for key, (got, supported) in unsupported.items():
        if transformer or (key == "ogate_act" and not cfg.get("use_output_gate")):
            continue
        if got != supported:
            raise PaperCheckpointError(
                f"config.json sets {key}={got!r}; fot's FoT models have {key}={supported!r} only"
            )
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads")
    for key in sizes:  # the paper's save_pretrained writes them all; a hand-edited file may not
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            got = "lacks it" if key not in cfg else f"sets {key}={value!r}"
            raise PaperCheckpointError(
                f"config.json {got}: {key} must be a positive integer; use the config.json "
                "that came with the checkpoint's weights"
            )
    heads = cfg["num_heads"]
    if cfg["hidden_size"] % heads:
        raise PaperCheckpointError(
            f"config.json sets hidden_size={cfg['hidden_size']} with num_heads={heads}: the "
            "hidden size must be a multiple of the number of heads"
        )
    kv_heads = cfg.get("num_kv_heads")
    if not transformer and kv_heads not in (None, heads):
        raise PaperCheckpointError(
            f"config.json sets num_kv_heads={kv_heads} with num_heads={heads}: the paper's FoX "
            "has no grouped-query attention, so no such checkpoint can come from it"
        )
    if kv_heads is not None and (
        isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1
        or heads % kv_heads
    ):  # fmt: skip
        raise PaperCheckpointError(
            f"config.json sets num_kv_heads={kv_heads!r} with num_heads={heads}: the key/value "
            "heads must be a positive integer that divides the heads"
        )
    window = cfg.get("window_size") if transformer else None  # the paper's FoX ignores it
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise PaperCheckpointError(
            f"config.json sets window_size={window!r}: a sliding window is a positive number "
            "of tokens, or null for none"
        )

    def pro(key: str) -> bool:  # the paper's Transformer has no Pro component
        return False if transformer else bool(cfg.get(key, False))

    return FoTConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=paper_intermediate_size(cfg),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=None if kv_heads in (None, heads) else int(kv_heads),
        window_size=window,
        fgate_type="none" if transformer else cfg.get("fgate_type", "full"),
        use_rope=bool(cfg.get("use_rope", transformer)),
        rope_theta=float(cfg.get("rope_base", 500000.0)),
        qk_norm=pro("qk_norm"),
        use_k_shift=pro("use_k_shift"),
        use_v_shift=pro("use_v_shift"),
        use_output_norm=pro("use_output_norm"),
        use_output_gate=pro("use_output_gate"),
        norm_eps=float(cfg.get("norm_eps", 1e-6)),
        max_position_embeddings=max(int(cfg.get("max_position_embeddings") or 0), 65536),
        bos_token_id=cfg.get("bos_token_id") if cfg.get("bos_token_id") is not None else EOT_ID,
        eos_token_id=cfg.get("eos_token_id") if cfg.get("eos_token_id") is not None else EOT_ID,
    )


def state_dict_from_paper(
    paper: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], fot_config: Any
) -> dict[str, torch.Tensor]:
    """fot's state dict for the paper's weights ``paper`` (of config ``cfg``).

    Raises:
        PaperCheckpointError: a weight is missing, has another shape, or is not used.
    """
    left = dict(paper)

    def take(name: str, *shape: int) -> torch.Tensor:
        """The paper's weight ``name``, of the ``shape`` its config.json implies."""
        if name not in left:
            raise PaperCheckpointError(
                f"the checkpoint lacks the weight {name!r} that its config.json implies; the "
                "folder is incomplete or from another version of the paper's code"
            )
        w = left.pop(name)
        if tuple(w.shape) != shape:
            raise PaperCheckpointError(
                f"the checkpoint's weight {name!r} has shape {tuple(w.shape)}, where its "
                f"config.json implies {shape}; the config.json is not this checkpoint's"
            )
        return w

    heads, hidden = fot_config.num_heads, fot_config.hidden_size
    head_dim = hidden // heads
    kv_dim = fot_config.kv_heads * head_dim
    width = paper_intermediate_size(cfg)
    vocab = fot_config.vocab_size
    out: dict[str, torch.Tensor] = {}
    # one q/k norm weight of head_dim shared by the heads, or one per head
    qk_norm_size = head_dim if cfg.get("qk_norm_share_param_across_head") else hidden

    def per_head(w: torch.Tensor) -> torch.Tensor:  # a q/k/o norm weight as [H, D]
        return (
            w.reshape(1, head_dim).expand(heads, head_dim)
            if w.numel() == head_dim
            else w.reshape(heads, head_dim)
        )

    padded = fot_config.padded_vocab_size

    def pad_rows(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w, w.new_zeros(padded - w.shape[0], w.shape[1])])

    embed = take("model.embeddings.weight", vocab, hidden)
    out["model.embed_tokens.weight"] = pad_rows(embed)
    out["model.norm.weight"] = take("model.norm.weight", hidden)
    if cfg.get("tie_word_embeddings", False):  # fot's models are untied: the head is a copy
        left.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    else:
        out["lm_head.weight"] = pad_rows(take("lm_head.weight", vocab, hidden))
    for i in range(fot_config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = take(src + "attn_norm.weight", hidden)
        out[dst + "post_attention_layernorm.weight"] = take(src + "mlp_norm.weight", hidden)
        gate_up = take(src + "mlp.gate_proj.weight", 2 * width, hidden)
        out[dst + "mlp.gate_proj.weight"] = gate_up[:width]
        out[dst + "mlp.up_proj.weight"] = gate_up[width:]
        out[dst + "mlp.down_proj.weight"] = take(src + "mlp.down_proj.weight", hidden, width)
        a, b = src + "attn.", dst + "self_attn."
        out[b + "q_proj.weight"] = take(a + "q_proj.weight", hidden, hidden)
        out[b + "o_proj.weight"] = take(a + "o_proj.weight", hidden, hidden)
        for name, shift in (("k", fot_config.use_k_shift), ("v", fot_config.use_v_shift)):
            if shift:
                linear, shift_proj = a + f"{name}_proj.linear.weight", a + f"{name}_proj.shift_proj"
                out[b + f"{name}_proj.weight"] = take(linear, hidden, hidden)
                out[b + f"{name}_shift_proj.weight"] = take(shift_proj + ".weight", heads, hidden)
            else:
                out[b + f"{name}_proj.weight"] = take(a + f"{name}_proj.weight", kv_dim, hidden)
        if fot_config.fgate_type == "full":
            out[b + "fgate_proj.weight"] = take(a + "fgate_proj.weight", heads, hidden)
            out[b + "fgate_proj.bias"] = take(a + "fgate_proj.bias", heads)
        elif fot_config.fgate_type in ("bias_only", "fixed"):
            out[b + "fgate_bias"] = take(a + "fgate_bias", heads)
        if fot_config.qk_norm:
            out[b + "q_norm.weight"] = per_head(take(a + "q_norm.weight", qk_norm_size))
            out[b + "k_norm.weight"] = per_head(take(a + "k_norm.weight", qk_norm_size))
        if fot_config.use_output_norm:
            out[b + "o_norm.weight"] = per_head(take(a + "output_norm.weight", hidden))
        if fot_config.use_output_gate:
            out[b + "g_proj.weight"] = take(a + "ogate_proj.weight", hidden, hidden)
    # rotary caches and other buffers the paper's code saves are recomputed by fot
    unused = sorted(k for k in left if not k.endswith(("inv_freq", "_cos_cached", "_sin_cached")))
    if unused:
        raise PaperCheckpointError(
            f"the checkpoint holds weights fot's conversion does not use: {unused[:6]}"
            f"{' ...' if len(unused) > 6 else ''}; its config.json does not describe them"
        )
    return {k: v.contiguous() for k, v in out.items()}


def from_paper(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Any:
    """Load a FoX or Transformer checkpoint folder of the paper's code as a
    :class:`fot.FoTForCausalLM`.

    Args:
        path: a local folder with the paper's ``config.json`` and weights (download a hub
            checkpoint first, e.g. ``hf download zhixuan-lin/fox-pro-760m-longcrawl64-48b
            --local-dir DIR``).
        dtype: cast the loaded model to this dtype (``None``: the weights' own).

    Returns:
        The model, in eval mode on the CPU; its logits are the paper model's for the same
        inputs (checked against the paper's code in tests/test_convert.py).

    Raises:
        PaperCheckpointError: not such a folder, or a setting fot cannot express.
    """
    from fot.export import read_weight_files
    from fot.models import FoTForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise PaperCheckpointError(
            f"{str(folder)!r} has no config.json: pass the folder of a checkpoint of the paper's "
            "code (downloaded whole)"
        )
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise PaperCheckpointError(f"{folder / 'config.json'} is not valid JSON ({err})") from err
    fot_config = fot_config_from_paper(cfg)
    state = state_dict_from_paper(read_weight_files(folder), cfg, fot_config)
    model = FoTForCausalLM(fot_config)
    model.load_state_dict(state, strict=True)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fot.convert SRC OUT``: write a paper FoX or Transformer checkpoint as a fot
    export."""
    from fot.errors import USER_ERRORS, error_line
    from fot.export import export_hf

    parser = argparse.ArgumentParser(
        prog="python -m fot.convert",
        description="Write a FoX or Transformer checkpoint folder of the paper's code "
        "(zhixuan-lin/forgetting-transformer) as a fot checkpoint folder.",
    )
    parser.add_argument("src", help="the paper checkpoint's folder (config.json and weights)")
    parser.add_argument("out", help="the folder to write (new or empty)")
    parser.add_argument(
        "--text-escaping",
        choices=["json", "none"],
        default="json",
        help="how the training text was escaped before tokenizing: json for LongCrawl64, which "
        "the paper's released models were trained on (default: %(default)s)",
    )
    args = parse_args_naming_typos(parser, argv)
    try:
        model = from_paper(args.src)
        out = export_hf(model, args.out, text_escaping=args.text_escaping)
    except USER_ERRORS as err:
        if os.environ.get("FOT_TRACEBACK") == "1":
            raise
        print(error_line(parser.prog, err, traceback_variable="FOT_TRACEBACK"), file=sys.stderr)
        return 2
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({n / 1e6:.1f}M parameters, model_type fot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
