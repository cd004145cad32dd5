"""Checkpoints of the paper's code (zhixuan-lin/forgetting-transformer) and of FLA's FoX as
fot models.

The paper released its 760M LongCrawl64 models (FoX (Pro), FoX (LLaMA), Transformer (Pro),
Transformer (LLaMA), ...) as Hugging Face folders of its own model types, which load only with
its package installed: ``forgetting_transformer-project_fox`` (FoX, and Transformer (Pro),
which is FoX with ``fgate_type="none"``) and ``transformer-project_fox`` (Transformer (LLaMA)
and the sliding-window Transformer). :func:`from_paper` reads such a folder (config and
weights, no code of the paper's package needed) into a :class:`fot.FoTForCausalLM` that
computes the same function; ``python -m fot.convert SRC OUT`` writes it as a fot export, which
``fot.eval`` and ``AutoModelForCausalLM`` (after ``import fot``) load like any other. The
paper's recurrent baselines DeltaNet, HGRN2 and Mamba-2 (``delta_net-project_fox``, ...)
become fot's FLA baselines of the same names (:func:`fla_config_from_paper`), whose folders
load with ``trust_remote_code=True``; its Samba is refused. :func:`from_fla` does the same for
flash-linear-attention's FoX (model type ``forgetting_transformer``, e.g. trained with FLA's
flame), whose export keeps the folder's own tokenizer files. The export keeps the source
weights' dtype (a bf16 checkpoint stays bf16, and ``from_pretrained`` loads it as bf16; FoX's
forget gate is written in float32; the recurrent baselines in float32, whose FLA layers compute
some gates in the dtype they are loaded in), or takes ``--dtype``.

The weights map one to one, renamed: the paper's fused MLP input projection is split into
fot's gate and up projections, its shift projections (``k_proj.shift_proj``) become
``k_shift_proj``, one q/k-norm weight shared by the heads is repeated per head, a tied LM head
becomes a copy of the embedding, and the embedding and LM head get fot's padded vocabulary
rows (zeros; their logits are cut off). FLA's FoX names its weights as fot does but for the
gate (``f_proj``: ``fgate_proj``), the norms (``attn_norm``, ``mlp_norm``) and the q/k norm
weights (one vector over the heads: ``[heads, head_dim]``). The paper's baselines keep FLA's
names; their fused MLP input projection is split the same way, and HGRN2's ``lower_bounds``
is dropped (the paper's HGRN2 never applies it: :func:`fla_config_from_paper`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fot.errors import FotError, parse_args_naming_typos

PAPER_MODEL_TYPE = "forgetting_transformer-project_fox"
"""``model_type`` in the config.json of the paper's FoX (and Transformer (Pro)) checkpoints."""

PAPER_TRANSFORMER_MODEL_TYPE = "transformer-project_fox"
"""``model_type`` in the config.json of the paper's Transformer (LLaMA) and sliding-window
Transformer checkpoints (its ``TransformerForCausalLM``: RoPE, no forget gate, GQA)."""

PAPER_BASELINE_MODEL_TYPES: dict[str, str] = {
    "delta_net-project_fox": "deltanet",
    "hgrn2-project_fox": "hgrn2",
    "mamba2-project_fox": "mamba2",
}
"""``model_type`` of the paper's recurrent baselines that convert, and fot's FLA baseline each
becomes (``model=deltanet``, ...)."""

PAPER_SAMBA_MODEL_TYPE = "samba-project_fox"
"""``model_type`` of the paper's Samba, which fot does not convert."""

PAPER_MODEL_TYPES = (PAPER_MODEL_TYPE, PAPER_TRANSFORMER_MODEL_TYPE, *PAPER_BASELINE_MODEL_TYPES)
"""The paper's model types that convert."""

FLA_MODEL_TYPE = "forgetting_transformer"
"""``model_type`` of flash-linear-attention's ``ForgettingTransformerForCausalLM`` (FLA's FoX,
as its ``save_pretrained`` and the flame trainer write it)."""


class ConversionError(FotError, ValueError):
    """A folder that is not a checkpoint fot converts, or one fot cannot express."""


def paper_intermediate_size(cfg: Mapping[str, Any]) -> int:
    """The MLP width the paper's code builds: ``intermediate_size``, else ``hidden_ratio``
    (default 4) x hidden x 2/3 rounded up to a multiple of 256."""
    if cfg.get("intermediate_size") is not None:
        return int(cfg["intermediate_size"])
    ratio = cfg.get("hidden_ratio") or 4
    width = int(cfg["hidden_size"] * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)


def _check_config_object(cfg: Any) -> None:
    if not isinstance(cfg, Mapping):
        raise ConversionError(
            f"config.json holds a {type(cfg).__name__}, not an object of settings: it is not a "
            "checkpoint's config.json"
        )


def _positive_int(cfg: Mapping[str, Any], key: str, *, optional: bool = False) -> int | None:
    value = cfg.get(key)
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        got = "lacks it" if key not in cfg else f"sets {key}={value!r}"
        raise ConversionError(
            f"config.json {got}: {key} must be a positive integer; use the config.json that "
            "came with the checkpoint's weights"
        )
    return value


def _check_sizes(cfg: Mapping[str, Any]) -> int:
    """Check the sizes every converted config.json states; returns ``num_heads``."""
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads")
    for key in sizes:  # save_pretrained writes them all; a hand-edited file may not
        _positive_int(cfg, key)
    heads = cfg["num_heads"]
    if cfg["hidden_size"] % heads:
        raise ConversionError(
            f"config.json sets hidden_size={cfg['hidden_size']} with num_heads={heads}: the "
            "hidden size must be a multiple of the number of heads"
        )
    return heads


def _kv_heads(cfg: Mapping[str, Any], heads: int) -> int | None:
    """``num_kv_heads`` for :class:`fot.FoTConfig` (``None``: as many as query heads)."""
    kv_heads = cfg.get("num_kv_heads")
    if kv_heads is not None and (
        isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1
        or heads % kv_heads
    ):  # fmt: skip
        raise ConversionError(
            f"config.json sets num_kv_heads={kv_heads!r} with num_heads={heads}: the key/value "
            "heads must be a positive integer that divides the heads"
        )
    return None if kv_heads in (None, heads) else int(kv_heads)


def fot_config_from_paper(cfg: Mapping[str, Any]) -> Any:
    """The :class:`fot.FoTConfig` of a paper FoX or Transformer config (a ``config.json`` dict).

    The paper's ``TransformerForCausalLM`` (``transformer-project_fox``) is fot's block without
    forget gate or Pro components, with RoPE on by default, and the only one of the paper's
    models with grouped-query attention (``num_kv_heads``) and a sliding window
    (``window_size``); its FoX reads neither.

    Raises:
        ConversionError: another model type, or a setting fot has no counterpart for
            (the message names it).
    """
    from fot.models import FoTConfig
    from fot.tokenizer import EOT_ID

    _check_config_object(cfg)
    model_type = cfg.get("model_type")
    if model_type in PAPER_BASELINE_MODEL_TYPES:
        return fla_config_from_paper(cfg)
    if model_type == PAPER_SAMBA_MODEL_TYPE:
        raise ConversionError(_SAMBA_REFUSAL)
    if model_type not in PAPER_MODEL_TYPES:
        raise ConversionError(
            f"config.json has model_type {model_type!r}, not one of the paper's models: "
            f"{PAPER_MODEL_TYPE!r} (FoX, Transformer (Pro)), {PAPER_TRANSFORMER_MODEL_TYPE!r} "
            "(Transformer (LLaMA), sliding window) or its recurrent baselines "
            f"{', '.join(repr(t) for t in PAPER_BASELINE_MODEL_TYPES)}"
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
            raise ConversionError(
                f"config.json sets {key}={got!r}; fot's FoT models have {key}={supported!r} only"
            )
    heads = _check_sizes(cfg)
    kv_heads = cfg.get("num_kv_heads")
    if not transformer and kv_heads not in (None, heads):
        raise ConversionError(
            f"config.json sets num_kv_heads={kv_heads} with num_heads={heads}: the paper's FoX "
            "has no grouped-query attention, so no such checkpoint can come from it"
        )
    kv_heads = _kv_heads(cfg, heads)
    window = cfg.get("window_size") if transformer else None  # the paper's FoX ignores it
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ConversionError(
            f"config.json sets window_size={window!r}: a sliding window is a positive number "
            "of tokens, or null for none"
        )

    def pro(key: str) -> bool:  # the paper's Transformer has no Pro component
        return False if transformer else bool(cfg.get(key, False))

    use_rope = bool(cfg.get("use_rope", transformer))
    fgate_type = "none" if transformer else cfg.get("fgate_type", "full")
    # the decay times that set the per-head gate biases of the gate ablations: a fixed gate's
    # buffer holds them (init_from compares them), a bias_only gate started from them
    decay_times = {
        k: float(cfg[k])
        for k in ("decay_time_min", "decay_time_max")
        if fgate_type in ("fixed", "bias_only") and cfg.get(k) is not None
    }
    return FoTConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=paper_intermediate_size(cfg),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        window_size=window,
        fgate_type=fgate_type,
        **decay_times,
        use_rope=use_rope,
        # the paper's configs hold a rope_base with or without RoPE; FoT keeps one it reads
        rope_theta=float(cfg.get("rope_base", 500000.0)) if use_rope else 500000.0,
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


_SAMBA_REFUSAL = (
    "config.json has model_type 'samba-project_fox', the paper's Samba, which fot does not "
    "convert: fot's samba is FLA's, whose attention layers need the flash-attn package, and "
    "no conversion of it has been checked against the paper's code; evaluate it with the "
    "paper's code"
)

# Settings of the paper's recurrent baselines that the conversion is checked for (its runs'
# values, which tests/paper_checkpoints/make.py builds): where another value would compute
# something else in FLA's model, or has not been compared, it is refused.
_BASELINE_CHECKED: dict[str, dict[str, Any]] = {
    "deltanet": {
        # without short convolutions the paper's DeltaNet applies no SiLU to q and k, FLA's does
        "use_short_conv": True,
        "use_gate": False,
        "use_beta": True,
        "qk_norm": "l2",
        "qk_activation": "silu",
        "norm_first": False,
        "hidden_act": "swish",
    },
    "hgrn2": {"use_short_conv": False, "elementwise_affine": True, "hidden_act": "swish"},
    "mamba2": {
        "n_groups": 1,  # the paper's Mamba-2 asserts it
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "rms_norm": True,
    },
}
# the paper's config key -> FLA's, where they differ (Mamba-2)
_BASELINE_RENAMED = {
    "layer_norm_epsilon": "norm_eps",
    "time_step_limit": "dt_limit",
    "rms_norm": "rmsnorm",
}
# the keys that carry over, besides the sizes and the checked settings
_BASELINE_KEYS: dict[str, tuple[str, ...]] = {
    "deltanet": ("num_heads", "expand_k", "expand_v", "conv_size", "use_output_norm",
                 "hidden_ratio", "intermediate_size", "norm_eps", "max_position_embeddings"),
    "hgrn2": ("num_heads", "expand_ratio", "conv_size", "hidden_ratio", "intermediate_size",
              "norm_eps", "max_position_embeddings"),
    # Mamba-2's head count FLA derives (expand x hidden_size / head_dim; checked against it)
    "mamba2": ("head_dim", "state_size", "expand", "conv_kernel", "residual_in_fp32",
               "layer_norm_epsilon", "time_step_limit", "chunk_size"),
}  # fmt: skip


# what the carried-over keys must be: a positive integer (or null where marked), a positive
# number, or a boolean
_BASELINE_KINDS: dict[str, str] = {
    **dict.fromkeys(
        ("conv_size", "hidden_ratio", "head_dim", "state_size", "expand", "conv_kernel"), "int"
    ),
    "chunk_size": "int",
    **dict.fromkeys(("intermediate_size", "max_position_embeddings"), "int or null"),
    **dict.fromkeys(("expand_k", "expand_v", "norm_eps", "layer_norm_epsilon"), "number"),
    **dict.fromkeys(("use_output_norm", "residual_in_fp32"), "bool"),
}


def _check_baseline_value(key: str, value: Any) -> None:
    kind = _BASELINE_KINDS.get(key)
    if kind is None or (kind == "int or null" and value is None):
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    good = {
        "int": isinstance(value, int) and number and value > 0,
        "int or null": isinstance(value, int) and number and value > 0,
        "number": number and value > 0,
        "bool": isinstance(value, bool),
    }[kind]
    if not good:
        what = {
            "int": "a positive integer",
            "int or null": "a positive integer or null",
            "number": "a positive number",
            "bool": "true or false",
        }[kind]
        raise ConversionError(
            f"config.json sets {key}={value!r}: it must be {what}; use the config.json that "
            "came with the checkpoint's weights"
        )


def _time_step_limit(value: Any) -> tuple[float, float]:
    """Mamba-2's ``time_step_limit`` as two floats: transformers 4 writes infinity as the JSON
    extension ``Infinity`` (``json`` reads it), transformers 5 as ``{"__float__": "Infinity"}``."""

    def number(x: Any) -> float:
        if isinstance(x, Mapping) and set(x) == {"__float__"}:
            x = x["__float__"]
        try:
            return float(x)
        except (TypeError, ValueError):
            raise ConversionError(
                f"config.json sets time_step_limit={value!r}: it must be two numbers "
                "(the paper's runs: [0.0, Infinity])"
            ) from None

    if not isinstance(value, (list, tuple)) or len(value) != 2:
        number(None)  # raises, naming the value
    return number(value[0]), number(value[1])


def fla_config_from_paper(cfg: Mapping[str, Any]) -> Any:
    """fot's FLA baseline config for a config.json of one of the paper's recurrent baselines
    (DeltaNet, HGRN2, Mamba-2: :data:`PAPER_BASELINE_MODEL_TYPES`).

    The paper's baselines are FLA's models of mid-2024 (its pinned commit 1c5937e) and
    HF's Mamba-2, under its own model types; fot's ``deltanet``, ``hgrn2`` and ``mamba2`` are
    today's FLA classes of the same names, which compute the same function from the same
    weights (checked against the paper's code in tests/test_convert.py) for the settings the
    paper's runs used.

    Raises:
        ConversionError: another model type, a size that is not a positive integer, or a
            setting the conversion is not checked for (named, with the value that converts).
    """
    from fot.models.fla_baselines import fla_config_class
    from fot.tokenizer import EOT_ID

    _check_config_object(cfg)
    name = PAPER_BASELINE_MODEL_TYPES.get(cfg.get("model_type"))
    if name is None:
        raise ConversionError(
            f"config.json has model_type {cfg.get('model_type')!r}, not one of the paper's "
            f"recurrent baselines {list(PAPER_BASELINE_MODEL_TYPES)}"
        )
    for key, checked in _BASELINE_CHECKED[name].items():
        if key in cfg and cfg[key] != checked:
            raise ConversionError(
                f"config.json sets {key}={cfg[key]!r}: fot converts the paper's "
                f"{cfg['model_type']} with {key}={checked!r} (its runs' setting) only; this "
                "setting's model has not been compared with FLA's"
            )
    hidden = _positive_int(cfg, "hidden_size")
    for key in ("vocab_size", "num_hidden_layers"):
        _positive_int(cfg, key)
    if name == "hgrn2":
        # the paper's HGRN2 takes num_heads as given, FLA's derives it from expand_ratio
        ratio = _positive_int(cfg, "expand_ratio")
        heads = _positive_int(cfg, "num_heads", optional=True)
        if heads not in (None, hidden // ratio) or hidden % ratio:
            raise ConversionError(
                f"config.json sets expand_ratio={ratio} and num_heads={heads} with "
                f"hidden_size={hidden}: fot converts HGRN2 models whose heads are hidden_size "
                "/ expand_ratio (num_heads null), as the paper's runs are"
            )
        cfg = {**cfg, "num_heads": hidden // ratio}
    elif name == "mamba2":
        heads, head_dim = _positive_int(cfg, "num_heads"), _positive_int(cfg, "head_dim")
        expand = _positive_int(cfg, "expand")
        if heads * head_dim != expand * hidden:
            raise ConversionError(
                f"config.json sets num_heads={heads} and head_dim={head_dim} with expand="
                f"{expand} and hidden_size={hidden}: Mamba-2's heads must span expand x "
                f"hidden_size = {expand * hidden} channels"
            )
    else:
        heads = _positive_int(cfg, "num_heads")
        if hidden % heads:
            raise ConversionError(
                f"config.json sets hidden_size={hidden} with num_heads={heads}: the hidden "
                "size must be a multiple of the number of heads"
            )
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", *_BASELINE_KEYS[name])
    for key in keys:
        if key in cfg:
            _check_baseline_value(key, cfg[key])
    fields = {_BASELINE_RENAMED.get(k, k): cfg[k] for k in keys if k in cfg}
    fields.update({_BASELINE_RENAMED.get(k, k): v for k, v in _BASELINE_CHECKED[name].items()})
    fields.pop("norm_first", None)  # FLA's blocks are pre-norm, the paper's too at False
    if "dt_limit" in fields:
        fields["dt_limit"] = _time_step_limit(fields["dt_limit"])
    fields.update(
        tie_word_embeddings=False,  # a tied head becomes a copy of the embedding
        fuse_cross_entropy=False,  # fot computes the loss (see fot.models.fla_baselines)
        bos_token_id=cfg.get("bos_token_id") if cfg.get("bos_token_id") is not None else EOT_ID,
        eos_token_id=cfg.get("eos_token_id") if cfg.get("eos_token_id") is not None else EOT_ID,
        pad_token_id=cfg.get("pad_token_id"),
    )
    if name != "mamba2":
        fields["attn_mode"] = "chunk"
    if name == "hgrn2":
        # The paper's HGRN2 block never passes its layer's lower bound on to the attention
        # (HGRN2Block.forward_attn takes lower_bound and drops it), so every layer's forget
        # gate is a plain sigmoid and the lower_bounds weight has no effect: FLA's HGRN2 without
        # lower bounds computes the same (checked against the paper's code).
        fields["use_lower_bound"] = False
    return fla_config_class(name)(**fields)


def state_dict_from_paper_baseline(
    paper: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], config: Any
) -> dict[str, torch.Tensor]:
    """fot's state dict for the weights of one of the paper's recurrent baselines.

    The names are FLA's; the one change is the MLP of DeltaNet and HGRN2, whose fused input
    projection (``mlp.gate_proj``, ``[2 x width, hidden]``: gate rows, then up rows) becomes
    FLA's ``gate_proj`` and ``up_proj``. A tied LM head becomes a copy of the embedding.

    Raises:
        ConversionError: a weight is missing, has another shape, or is not used.
    """
    from fot.models.fla_baselines import build_fla_model

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in build_fla_model(config).state_dict().items()}
    weights = _Weights(paper)
    out: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        if key.endswith("mlp.gate_proj.weight"):
            width = shape[0]
            gate_up = weights.take(key, 2 * width, shape[1])
            out[key] = gate_up[:width]
            out[key.replace("gate_proj", "up_proj")] = gate_up[width:]
        elif key.endswith("mlp.up_proj.weight"):
            continue
        elif key == "lm_head.weight" and cfg.get("tie_word_embeddings", False):
            weights.left.pop(key, None)
            embedding = next(k for k in shapes if k.endswith("embeddings.weight"))
            out[key] = paper[embedding].clone()
        else:
            out[key] = weights.take(key, *shape)
    # HGRN2's lower bounds, which the paper's code never applies (fla_config_from_paper)
    weights.left.pop("model.lower_bounds", None)
    weights.check_all_used()
    return {k: v.contiguous() for k, v in out.items()}


class _Weights:
    """A checkpoint's weights, taken one by one in the shapes its config.json implies."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.left = dict(weights)

    def take(self, name: str, *shape: int) -> torch.Tensor:
        """The weight ``name``, of ``shape``."""
        if name not in self.left:
            raise ConversionError(
                f"the checkpoint lacks the weight {name!r} that its config.json implies; the "
                "folder is incomplete or from another version of the code that wrote it"
            )
        w = self.left.pop(name)
        if tuple(w.shape) != shape:
            raise ConversionError(
                f"the checkpoint's weight {name!r} has shape {tuple(w.shape)}, where its "
                f"config.json implies {shape}; the config.json is not this checkpoint's"
            )
        return w

    def embedding_and_head(self, cfg: Mapping[str, Any], fot_config: Any) -> dict[str, Any]:
        """fot's embedding, final norm and LM head from ``model.embeddings``, ``model.norm``
        and ``lm_head`` (both source layouts name them so), with fot's padded vocabulary rows
        (zeros); a tied head becomes a copy of the embedding (fot's models are untied)."""
        vocab, hidden = fot_config.vocab_size, fot_config.hidden_size
        padded = fot_config.padded_vocab_size

        def pad_rows(w: torch.Tensor) -> torch.Tensor:
            return torch.cat([w, w.new_zeros(padded - w.shape[0], w.shape[1])])

        out = {
            "model.embed_tokens.weight": pad_rows(
                self.take("model.embeddings.weight", vocab, hidden)
            )
        }
        out["model.norm.weight"] = self.take("model.norm.weight", hidden)
        if cfg.get("tie_word_embeddings", False):
            self.left.pop("lm_head.weight", None)
            out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
        else:
            out["lm_head.weight"] = pad_rows(self.take("lm_head.weight", vocab, hidden))
        return out

    def check_all_used(self, ignore: tuple[str, ...] = ()) -> None:
        """Raise if weights are left (but those whose names end with one of ``ignore``)."""
        unused = sorted(k for k in self.left if not k.endswith(ignore))
        if unused:
            raise ConversionError(
                f"the checkpoint holds weights fot's conversion does not use: {unused[:6]}"
                f"{' ...' if len(unused) > 6 else ''}; its config.json does not describe them"
            )


def state_dict_from_paper(
    paper: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], fot_config: Any
) -> dict[str, torch.Tensor]:
    """fot's state dict for the paper's weights ``paper`` (of config ``cfg``).

    Raises:
        ConversionError: a weight is missing, has another shape, or is not used.
    """
    if cfg.get("model_type") in PAPER_BASELINE_MODEL_TYPES:
        return state_dict_from_paper_baseline(paper, cfg, fot_config)
    weights = _Weights(paper)
    take = weights.take
    heads, hidden = fot_config.num_heads, fot_config.hidden_size
    head_dim = hidden // heads
    kv_dim = fot_config.kv_heads * head_dim
    width = paper_intermediate_size(cfg)
    # one q/k norm weight of head_dim shared by the heads, or one per head
    qk_norm_size = head_dim if cfg.get("qk_norm_share_param_across_head") else hidden

    def per_head(w: torch.Tensor) -> torch.Tensor:  # a q/k/o norm weight as [H, D]
        return (
            w.reshape(1, head_dim).expand(heads, head_dim)
            if w.numel() == head_dim
            else w.reshape(heads, head_dim)
        )

    out = weights.embedding_and_head(cfg, fot_config)
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
    weights.check_all_used(ignore=("inv_freq", "_cos_cached", "_sin_cached"))
    return {k: v.contiguous() for k, v in out.items()}


def from_paper(path: str | os.PathLike, *, dtype: torch.dtype | str | None = None) -> Any:
    """Load a checkpoint folder of the paper's code as a fot model: a
    :class:`fot.FoTForCausalLM` for FoX and the Transformers, fot's FLA baseline
    (``FoTDeltaNetForCausalLM``, ...) for DeltaNet, HGRN2 and Mamba-2.

    Args:
        path: a local folder with the paper's ``config.json`` and weights (download a hub
            checkpoint first, e.g. ``hf download zhixuan-lin/fox-pro-760m-longcrawl64-48b
            --local-dir DIR``).
        dtype: cast the loaded model to this dtype (``None``: float32, whatever the weights'
            dtype; 16-bit weights convert exactly; ``"auto"``: the dtype of most of the
            weights, :func:`weights_dtype`); a FoX model keeps its forget gate in float32
            under a 16-bit cast.

    Returns:
        The model, in eval mode on the CPU; its logits are the paper model's for the same
        inputs (checked against the paper's code in tests/test_convert.py).

    Raises:
        ConversionError: not such a folder, or a setting fot cannot express.
    """
    return _load(path, fot_config_from_paper, state_dict_from_paper, dtype)


def read_config(path: str | os.PathLike) -> Any:
    """The ``config.json`` of checkpoint folder ``path`` (any JSON value).

    Raises:
        ConversionError: no such file, or not JSON.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConversionError(
            f"{str(folder)!r} is no folder: pass the folder of a checkpoint (downloaded or "
            "copied whole), or a hub repository id (owner/name)"
        )
    if not (folder / "config.json").is_file():
        raise ConversionError(
            f"{str(folder)!r} has no config.json: pass the folder of a checkpoint (downloaded "
            "or copied whole)"
        )
    try:
        return json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversionError(f"{folder / 'config.json'} is not valid JSON ({err})") from err


def _load(
    path: str | os.PathLike,
    to_config: Callable[[Any], Any],
    to_state: Callable[[Mapping[str, torch.Tensor], Any, Any], dict[str, torch.Tensor]],
    dtype: torch.dtype | str | None,
) -> Any:
    """A :class:`fot.FoTForCausalLM` from checkpoint folder ``path``, by a config and a
    state-dict mapping."""
    from fot.export import read_weight_files
    from fot.models import FoTConfig, FoTForCausalLM
    from fot.models.fla_baselines import build_fla_model

    cfg = read_config(path)
    fot_config = to_config(cfg)
    weights = read_weight_files(Path(path))
    if dtype == "auto":
        dtype = weights_dtype(weights)
    elif isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        dtype = getattr(torch, dtype)  # "bfloat16", as --dtype and from_pretrained take it
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"dtype={dtype!r} is not a floating torch dtype (torch.bfloat16 or 'bfloat16', "
            "float16, float32), 'auto' or None"
        )
    state = to_state(weights, cfg, fot_config)
    if isinstance(fot_config, FoTConfig):
        model = FoTForCausalLM(fot_config)
    else:
        model = build_fla_model(fot_config)
    model.load_state_dict(state, strict=True)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def weights_dtype(weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype that holds most of the values of ``weights`` (a bf16 checkpoint with a
    few float32 tensors is bf16); float32 where none is floating."""
    counts: dict[torch.dtype, int] = {}
    for t in weights.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def fot_config_from_fla(cfg: Mapping[str, Any]) -> Any:
    """The :class:`fot.FoTConfig` of an FLA FoX config (a ``config.json`` dict).

    FLA's FoX is fot's block with the data-dependent forget gate, no RoPE, optional per-head
    q/k RMS norms (eps 1e-5) and sigmoid output gate (no output norm), grouped-query attention,
    and a SwiGLU MLP.

    Raises:
        ConversionError: another model type, or a setting fot has no counterpart for (the
            message names it and what to do).
    """
    from fot.models import FoTConfig

    _check_config_object(cfg)
    if cfg.get("model_type") != FLA_MODEL_TYPE:
        raise ConversionError(
            f"config.json has model_type {cfg.get('model_type')!r}, not FLA's FoX "
            f"{FLA_MODEL_TYPE!r}"
        )
    if cfg.get("qkv_bias"):
        raise ConversionError(
            "config.json sets qkv_bias=true: fot's q/k/v projections have no bias, so this "
            "checkpoint cannot be expressed"
        )
    if cfg.get("window_size") is not None:
        raise ConversionError(
            f"config.json sets window_size={cfg['window_size']!r}, which FLA's FoX forward "
            "ignores (full attention) while its decoding cache keeps only that window: the "
            "two disagree, so fot does not guess; set it to null in a copy of the folder to "
            "convert the full-attention model that FLA trained"
        )
    if cfg.get("attnres_block_size") is not None:
        raise ConversionError(
            f"config.json sets attnres_block_size={cfg['attnres_block_size']!r}: FLA's "
            "attention residuals have no counterpart in fot"
        )
    if cfg.get("hidden_act", "swish") != "swish":
        raise ConversionError(
            f"config.json sets hidden_act={cfg['hidden_act']!r}; fot's MLP is SwiGLU "
            "(hidden_act='swish') only"
        )
    heads = _check_sizes(cfg)
    return FoTConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=paper_intermediate_size(cfg),  # FLA's GatedMLP rounds alike
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=_kv_heads(cfg, heads),
        fgate_type="full",
        use_rope=False,
        qk_norm=bool(cfg.get("qk_norm", False)),
        qk_norm_eps=1e-5,  # FLA's GroupNorm default, which its q/k norms use
        use_output_gate=bool(cfg.get("use_output_gate", False)),
        norm_eps=float(cfg.get("norm_eps", 1e-6)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
    )


def state_dict_from_fla(
    fla: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], fot_config: Any
) -> dict[str, torch.Tensor]:
    """fot's state dict for FLA FoX weights ``fla`` (of config ``cfg``): the same names but
    for the gate (``f_proj`` becomes ``fgate_proj``) and the norms (``attn_norm``,
    ``mlp_norm``), with the q/k norm weights as ``[heads, head_dim]``.

    Raises:
        ConversionError: a weight is missing, has another shape, or is not used.
    """
    weights = _Weights(fla)
    take = weights.take
    heads, hidden = fot_config.num_heads, fot_config.hidden_size
    head_dim = hidden // heads
    kv_heads = fot_config.kv_heads
    width = fot_config.intermediate_size
    out = weights.embedding_and_head(cfg, fot_config)
    for i in range(fot_config.num_hidden_layers):
        src = dst = f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = take(src + "attn_norm.weight", hidden)
        out[dst + "post_attention_layernorm.weight"] = take(src + "mlp_norm.weight", hidden)
        for name, shape in (("gate", (width, hidden)), ("up", (width, hidden)),
                            ("down", (hidden, width))):  # fmt: skip
            out[dst + f"mlp.{name}_proj.weight"] = take(src + f"mlp.{name}_proj.weight", *shape)
        a, b = src + "attn.", dst + "self_attn."
        for name, rows in (("q", hidden), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim),
                           ("o", hidden)):  # fmt: skip
            out[b + f"{name}_proj.weight"] = take(a + f"{name}_proj.weight", rows, hidden)
        out[b + "fgate_proj.weight"] = take(a + "f_proj.weight", heads, hidden)
        out[b + "fgate_proj.bias"] = take(a + "f_proj.bias", heads)
        if fot_config.qk_norm:
            q_norm = take(a + "q_norm.weight", hidden)
            out[b + "q_norm.weight"] = q_norm.reshape(heads, head_dim)
            k_norm = take(a + "k_norm.weight", kv_heads * head_dim)
            out[b + "k_norm.weight"] = k_norm.reshape(kv_heads, head_dim)
        if fot_config.use_output_gate:
            out[b + "g_proj.weight"] = take(a + "g_proj.weight", hidden, hidden)
    weights.check_all_used()
    return {k: v.contiguous() for k, v in out.items()}


def from_fla(path: str | os.PathLike, *, dtype: torch.dtype | str | None = None) -> Any:
    """Load a checkpoint folder of flash-linear-attention's FoX (``ForgettingTransformer-
    ForCausalLM``, model type ``forgetting_transformer``) as a :class:`fot.FoTForCausalLM`.

    Args:
        path: a local folder with FLA's ``config.json`` and weights.
        dtype: cast the loaded model to this dtype (``None``: float32, whatever the weights'
            dtype; 16-bit weights convert exactly; ``"auto"``: the dtype of most of the
            weights, :func:`weights_dtype`); the forget gate stays float32 under a 16-bit cast.

    Returns:
        The model, in eval mode on the CPU; its logits are FLA's model's for the same inputs
        (checked against FLA in tests/test_convert.py).

    Raises:
        ConversionError: not such a folder, or a setting fot cannot express.
    """
    return _load(path, fot_config_from_fla, state_dict_from_fla, dtype)


def source_kind(cfg: Any) -> str:
    """``"fla"`` for an FLA FoX config.json, ``"paper"`` for one of the paper's models
    (:data:`PAPER_MODEL_TYPES`).

    Raises:
        ConversionError: a config.json of neither.
    """
    _check_config_object(cfg)
    if cfg.get("model_type") == FLA_MODEL_TYPE:
        return "fla"
    if cfg.get("model_type") in PAPER_MODEL_TYPES:
        return "paper"
    if cfg.get("model_type") == PAPER_SAMBA_MODEL_TYPE:
        raise ConversionError(_SAMBA_REFUSAL)
    if str(cfg.get("model_type")).startswith("fot"):  # fot, fot_mamba2, ...
        raise ConversionError(
            f"config.json has model_type {cfg['model_type']!r}: the folder holds a fot model "
            "already, which needs no conversion; load it as it is (python -m fot.eval, "
            "train.py init_from=<the folder>, or AutoModelForCausalLM after import fot)"
        )
    raise ConversionError(
        f"config.json has model_type {cfg.get('model_type')!r}: fot converts the paper's "
        f"models ({', '.join(PAPER_MODEL_TYPES)}) and FLA's FoX ({FLA_MODEL_TYPE})"
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")  # fmt: skip
"""The files of a Hugging Face tokenizer that :func:`copy_tokenizer` copies."""


def copy_tokenizer(src: str | os.PathLike, out: str | os.PathLike, text_escaping: str) -> list[str]:
    """Copy the tokenizer files of checkpoint folder ``src`` into export ``out``, recording
    ``text_escaping`` for ``fot.eval`` (``"none"``: none, also where ``src`` recorded one).

    Tokenizer files in ``out`` that ``src`` lacks (an earlier export's GPT-2 ``vocab.json``
    beside another tokenizer's ``tokenizer.json``) are removed, so that ``out`` holds one
    tokenizer.

    Returns:
        The names copied.
    """
    from fot.tokenizer import TEXT_ESCAPING_KEY

    copied = [n for n in TOKENIZER_FILES if (Path(src) / n).is_file()]
    for name in TOKENIZER_FILES:
        if name in copied:
            shutil.copyfile(Path(src) / name, Path(out) / name)
        else:
            Path(out, name).unlink(missing_ok=True)
    config_file = Path(out) / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    recorded = config.pop(TEXT_ESCAPING_KEY, "none")
    if copied and recorded != text_escaping:
        if text_escaping != "none":
            config[TEXT_ESCAPING_KEY] = text_escaping
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    return copied


def pruning_note(cfg: Mapping[str, Any]) -> str | None:
    """What a paper config's ``log_pruning_tolerance`` becomes in fot, or None without one."""
    tolerance = cfg.get("log_pruning_tolerance")
    if tolerance is None:
        return None
    return (
        f"note: config.json sets log_pruning_tolerance={tolerance}, the paper's adaptive "
        f"pruning (it drops attention weights up to a total of exp({tolerance}) per row); "
        "fot skips only weights that are exactly zero in float32, so the converted model "
        "computes the full attention"
    )


_DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The choices of ``python -m fot.convert --dtype``."""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fot.convert SRC OUT``: write a checkpoint of the paper's code or of FLA's FoX
    as a fot export."""
    from fot.errors import USER_ERRORS, error_line
    from fot.export import check_export_folder, export_hf, is_fot_export
    from fot.hub import local_folder

    parser = argparse.ArgumentParser(
        prog="python -m fot.convert",
        description="Write a checkpoint folder of the paper's code (zhixuan-lin/"
        "forgetting-transformer: FoX, Transformer, DeltaNet, HGRN2, Mamba-2; with fot's GPT-2 "
        "tokenizer) or of "
        "flash-linear-attention's FoX (model_type forgetting_transformer; with its own "
        "tokenizer files) as a fot checkpoint folder.",
    )
    parser.add_argument(
        "src",
        help="the checkpoint's folder (config.json and weights), or a hub repository id "
        "(owner/name, e.g. zhixuan-lin/fox-pro-760m-longcrawl64-48b) to download",
    )
    parser.add_argument(
        "out", help="the folder to write (new, empty, or an earlier export, which it replaces)"
    )
    parser.add_argument(
        "--text-escaping",
        choices=["json", "none"],
        default=None,
        help="how the training text was escaped before tokenizing: json for LongCrawl64, "
        "which the paper's released models were trained on (default: json for the paper's "
        "checkpoints, none for FLA's)",
    )
    parser.add_argument(
        "--dtype",
        choices=list(_DTYPES),
        default="auto",
        help="the dtype of the written weights (default: auto, the source weights' dtype, as "
        "save_pretrained keeps a model's; a FoX forget gate is written in float32 always; "
        "DeltaNet, HGRN2 and Mamba-2 in float32, as FLA's layers compute some gates in the "
        "dtype they are loaded in)",
    )
    args = parse_args_naming_typos(parser, argv)
    dtype = _DTYPES[args.dtype]
    copied: list[str] = []
    replaces = False
    try:
        check_export_folder(args.out, example="checkpoints/fox_pro_760m")
        replaces = is_fot_export(Path(args.out))
        src = local_folder(args.src)
        if (src / "trainer.json").is_file():  # read_config would say it has no config.json
            raise ConversionError(
                f"{args.src} is a training checkpoint of fot, which needs no conversion: export "
                f"it with python -m fot.export {args.src} {args.out}, "
                f"or train on from its weights with train.py init_from={args.src}"
            )
        if (src / "run_info.json").is_file():  # read_config would say it has no config.json
            final = src / "hf"
            loads = (
                f"its final weights are in {final}; load that as it is (python -m fot.eval, "
                "train.py init_from=<that folder>, or AutoModelForCausalLM after import fot)"
                if (final / "config.json").is_file()
                else "export a checkpoint of it with python -m fot.export "
                f"{src / 'checkpoints' / 'step_<n>'} {args.out}"
            )
            raise ConversionError(
                f"{args.src} is a training run of fot, which needs no conversion: {loads}"
            )
        source_config = read_config(src)
        fla = source_kind(source_config) == "fla"
        if dtype == "auto" and source_config.get("model_type") in PAPER_BASELINE_MODEL_TYPES:
            # loaded in 16 bits (from_pretrained's default: the folder's dtype), their gates
            # would be computed in 16 bits (_FoTContractMixin.compute_dtype says how)
            dtype = torch.float32
        model = from_fla(src, dtype=dtype) if fla else from_paper(src, dtype=dtype)
        if fla:
            escaping = args.text_escaping or "none"
            out = export_hf(model, args.out, tokenizer=False)
            copied = copy_tokenizer(src, out, escaping)
        else:
            out = export_hf(model, args.out, text_escaping=args.text_escaping or "json")
    except USER_ERRORS as err:
        if os.environ.get("FOT_TRACEBACK") == "1":
            raise
        print(error_line(parser.prog, err, traceback_variable="FOT_TRACEBACK"), file=sys.stderr)
        return 2
    n = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {out} ({n / 1e6:.1f}M parameters, model_type {model.config.model_type}, "
        f"{str(model.dtype).removeprefix('torch.')})"
        + (", replacing the earlier export there" if replaces else "")
    )
    if not fla and args.text_escaping is None:
        print(
            "note: fot.eval will JSON-escape its texts for this model, as the paper's released "
            "models were trained on LongCrawl64's JSON-escaped text; for a model trained on "
            f"plain text, convert with --text-escaping none (python -m fot.convert {args.src} "
            f"{args.out} --text-escaping none)"
        )
    note = None if fla else pruning_note(source_config)
    if note:
        print(note)
    if fla and not copied:
        print(
            f"{args.src} holds no tokenizer files: copy the tokenizer the model was trained "
            f"with into {out} before evaluating it with fot.eval",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
