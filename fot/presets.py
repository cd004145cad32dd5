"""Named model presets: ``config("fot_pro", "760m")`` gives the paper's configuration.

Sizes follow the FoX paper (App. B, Table 4): hidden 768 / 1024 / 1536 with 12 / 24 / 24
layers. FoT models use head dim 64; the Transformer baselines use 12 / 16 / 12 heads (head dim
64 / 64 / 128), as in the paper's code. Pro models shrink the SwiGLU MLP (``hidden_ratio`` 3.5
instead of 4) so that their parameter count matches the LLaMA variants. ``tiny`` (hidden 128,
2 layers, 4 heads) trains on a laptop CPU in about a second per step at T=256.

Parameter counts in the paper count every weight except the input embedding (the untied LM
head included); :func:`count_params` uses the same convention.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PretrainedConfig

from fot.models.configuration_fot import FoTConfig
from fot.models.fla_baselines import FLA_MODELS, fla_config

SIZES = ("tiny", "125m", "360m", "760m")

# hidden, layers, heads of FoT models (head dim 64), heads of Transformer baselines
_SIZE_TABLE: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "fot_heads": 4, "tf_heads": 4},
    "125m": {"hidden_size": 768, "num_hidden_layers": 12, "fot_heads": 12, "tf_heads": 12},
    "360m": {"hidden_size": 1024, "num_hidden_layers": 24, "fot_heads": 16, "tf_heads": 16},
    "760m": {"hidden_size": 1536, "num_hidden_layers": 24, "fot_heads": 24, "tf_heads": 12},
}

_PRO = {
    "qk_norm": True,
    "use_k_shift": True,
    "use_v_shift": True,
    "use_output_norm": True,
    "use_output_gate": True,
    "hidden_ratio": 3.5,  # the output gate adds hidden^2 per layer: shrink the MLP to match
}
_TRANSFORMER = {"fgate_type": "none", "use_rope": True}

# model name -> (FoT config fields, uses Transformer head count)
_FOT_MODELS: dict[str, tuple[dict[str, Any], bool]] = {
    "fot_pro": (dict(_PRO), False),
    "fot_llama": ({}, False),
    "transformer_pro": ({**_PRO, **_TRANSFORMER}, True),
    "transformer_llama": (dict(_TRANSFORMER), True),
    "transformer_llama_nope": ({"fgate_type": "none", "use_rope": False}, True),
    "transformer_swa": ({**_TRANSFORMER, "window_size": 2048}, True),
    "fot_llama_bias_only": ({"fgate_type": "bias_only"}, False),
    "fot_llama_fixed": ({"fgate_type": "fixed"}, False),
    "fot_pro_bias_only": ({**_PRO, "fgate_type": "bias_only"}, False),
    "fot_pro_fixed": ({**_PRO, "fgate_type": "fixed"}, False),
}

MODELS: tuple[str, ...] = (*_FOT_MODELS, *FLA_MODELS)


def config(model: str, size: str = "tiny", **overrides: Any) -> PretrainedConfig:
    """HF config of a named model at a named size.

    Args:
        model: one of :data:`MODELS` (e.g. ``"fot_pro"``, ``"transformer_llama"``, ``"mamba2"``).
        size: one of :data:`SIZES`.
        **overrides: config fields to set (validated by the config class).

    Returns:
        A :class:`fot.FoTConfig` for FoT / Transformer models, else the FLA config class.

    Raises:
        ValueError: unknown model or size (the message lists the valid names).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; valid models: {list(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {list(SIZES)}")
    if model in FLA_MODELS:
        return fla_config(model, size, **overrides)
    fields, transformer_heads = _FOT_MODELS[model]
    dims = _SIZE_TABLE[size]
    kwargs: dict[str, Any] = {
        "hidden_size": dims["hidden_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_heads": dims["tf_heads"] if transformer_heads else dims["fot_heads"],
        **fields,
    }
    if size == "tiny" and "window_size" in kwargs:
        kwargs["window_size"] = 64  # keep the window smaller than tiny test sequences
    kwargs.update(overrides)
    return FoTConfig(**kwargs)


def build_model(config: PretrainedConfig) -> nn.Module:
    """Instantiate the model class of a config (FoTForCausalLM or the FLA model class).

    Args:
        config: from :func:`config` (or any ``FoTConfig`` / FLA config).

    Returns:
        The randomly initialised causal LM (on the current default device).
    """
    if isinstance(config, FoTConfig):
        from fot.models.modeling_fot import FoTForCausalLM

        return FoTForCausalLM(config)
    from fot.models.fla_baselines import build_fla_model

    return build_fla_model(config)


def count_params(model: nn.Module, *, exclude_input_embedding: bool = True) -> int:
    """Number of parameters, by default without the input embedding (the paper's convention).

    Works on ``meta``-device models.
    """
    total = sum(p.numel() for p in model.parameters())
    if exclude_input_embedding:
        total -= model.get_input_embeddings().weight.numel()
    return total


__all__ = ["MODELS", "SIZES", "build_model", "config", "count_params"]
