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

import dataclasses
import difflib
import inspect
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from fot.models.configuration_fot import FoTConfig, gate_init_problem, merge_overrides
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
        ValueError: unknown model or size (the message lists the valid names), an override
            that is no field of the model's config class (the message names it, the closest
            field names and the fix), or one of a type the field does not take.
    """
    _check_names(model, size)
    if model in FLA_MODELS:
        cfg = fla_config(model, size)  # the class first, so that no override is applied unchecked
        check_override_keys(model, type(cfg), overrides)
        check_override_types(model, cfg, overrides)
        return fla_config(model, size, **overrides)
    kwargs = _fot_kwargs(model, size, overrides)
    unread = _unread_fields(kwargs, overrides)
    # the fields it reads first: an error of those names them; then the unread ones, named
    # for the preset (FoTConfig itself refuses them too)
    built = FoTConfig(**{key: value for key, value in kwargs.items() if key not in unread})
    if problem := _unread_override_problem(model, overrides, unread):
        raise ValueError(problem)
    return built


def read_overrides(model: str, size: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` without the fields that ``model`` does not read, which :func:`config`
    refuses (a RoPE base on a model without RoPE, a QK-norm epsilon on one without QK-norm,
    ``hidden_ratio`` beside ``intermediate_size``): they give the same model as ``overrides``. A run that an older fot
    started with such a field records it; its checkpoints are read with this.

    Args:
        model: one of :data:`MODELS`.
        size: one of :data:`SIZES`.
        overrides: config fields, as given to :func:`config`.

    Returns:
        The overrides that :func:`config` reads (all of them for an FLA model).

    Raises:
        ValueError: any other override that :func:`config` refuses.
    """
    _check_names(model, size)
    if model in FLA_MODELS:
        return dict(overrides)
    kwargs = _fot_kwargs(model, size, overrides)
    unread = _unread_fields(kwargs, overrides)
    FoTConfig(**{key: value for key, value in kwargs.items() if key not in unread})  # the rest
    return {key: value for key, value in overrides.items() if key not in unread}


def _check_names(model: str, size: str) -> None:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; valid models: {list(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {list(SIZES)}")


def _fot_kwargs(model: str, size: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The ``FoTConfig`` keywords of preset ``model`` at ``size`` with ``overrides``, unread
    ones included."""
    check_override_keys(model, FoTConfig, overrides)
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
    # an override under a LLaMA name (num_attention_heads) replaces the preset's FoT name
    kwargs = merge_overrides(kwargs, overrides)
    if problem := gate_init_problem(kwargs, subject=f"model {model!r}"):  # named the preset
        raise ValueError(problem)
    return kwargs


def _unread_fields(kwargs: Mapping[str, Any], overrides: Mapping[str, Any]) -> list[str]:
    """The keys of ``overrides`` that the model of ``kwargs`` (its FoTConfig keywords, the
    overrides merged in) does not read."""
    unread = (
        []
        if kwargs.get("use_rope") is True
        else [n for n in ("rope_theta", "rope_parameters") if n in overrides]
    )
    if kwargs.get("qk_norm") is not True and "qk_norm_eps" in overrides:
        unread.append("qk_norm_eps")
    if overrides.get("intermediate_size") is not None and "hidden_ratio" in overrides:
        unread.append("hidden_ratio")
    return unread


def _unread_override_problem(
    model: str, overrides: Mapping[str, Any], unread: list[str]
) -> str | None:
    """Why an override of ``model`` sets a field that its model does not read, with the fix;
    ``None`` where every one is read. Such a field is stored in config.json and ignored (a
    ``rope_theta`` swept over ``model=fot_pro,transformer_pro`` changes only the Transformer,
    a ``qk_norm_eps`` over ``model=fot_pro,fot_llama`` only FoT (Pro)). A RoPE base or QK-norm
    epsilon at its default changes nothing and passes (every saved config.json has both).

    Args:
        model: the preset name (for the message).
        overrides: the fields the user set.
        unread: the keys of ``overrides`` it does not read (:func:`_unread_fields`).
    """
    rope = {name: overrides[name] for name in unread if name in ("rope_theta", "rope_parameters")}
    # the base they give (rope_parameters' as rope_theta), as a model with RoPE reads it
    if rope and FoTConfig(use_rope=True, **rope).rope_theta != FoTConfig().rope_theta:
        given = ", ".join(f"{name}={value!r}" for name, value in rope.items())
        return (
            f"model {model!r} has no RoPE (use_rope=False), so it does not read {given}: leave "
            f"it out for this model, or set use_rope=true as well for RoPE "
            "(+model.overrides.use_rope=true)"
        )
    if "qk_norm_eps" in unread and overrides["qk_norm_eps"] != FoTConfig().qk_norm_eps:
        return (
            f"model {model!r} has no QK-norm (qk_norm=False), so it does not read "
            f"qk_norm_eps={overrides['qk_norm_eps']!r}: leave it out for this model, or set "
            "qk_norm=true as well for a QK-norm (+model.overrides.qk_norm=true)"
        )
    if "hidden_ratio" in unread:
        return (
            f"model {model!r} gets intermediate_size={overrides['intermediate_size']!r}, which "
            f"sets the MLP width, so it does not read hidden_ratio={overrides['hidden_ratio']!r}: "
            "give only one of them"
        )
    return None


# Keywords every transformers config accepts besides its dataclass fields
# (``PretrainedConfig.__post_init__``).
_BASE_CONFIG_KEYS = frozenset(
    {
        "torch_dtype",
        "num_labels",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "name_or_path",
    }
)


def config_keys(config_cls: type[PretrainedConfig]) -> frozenset[str]:
    """Every keyword that ``config_cls(**kwargs)`` reads as a config field.

    The named parameters of the ``__init__`` of each class in its MRO, the dataclass fields,
    the ``attribute_map`` aliases, the keywords every transformers config accepts (``dtype``,
    ``attn_implementation``, ...) and, for :class:`FoTConfig`, the LLaMA names and foreign
    fields it maps or refuses (:meth:`FoTConfig.constructor_keys`). Anything else would be
    stored on the config and ignored by the model.
    """
    keys = set(_BASE_CONFIG_KEYS)
    for klass in config_cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None and klass is not object:
            params = inspect.signature(init).parameters.values()
            keys.update(
                p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            )
        if dataclasses.is_dataclass(klass):
            keys.update(f.name for f in dataclasses.fields(klass))
        keys.update(getattr(klass, "attribute_map", None) or {})
    constructor_keys = getattr(config_cls, "constructor_keys", None)
    if constructor_keys is not None:
        keys.update(constructor_keys())
    keys.discard("self")
    return frozenset(keys)


# transformers' fields for sequence-classification heads: no causal LM reads them, so they are
# never the field a misspelt override meant (num_heads -> num_labels)
_CLASSIFICATION_KEYS = frozenset({"num_labels", "id2label", "label2id", "problem_type"})


def check_override_keys(
    model: str, config_cls: type[PretrainedConfig], overrides: Mapping[str, Any]
) -> None:
    """Refuse override keys that are no field of ``config_cls`` (typos such as ``hidden_sise``).

    transformers configs store unknown keywords as attributes that no model reads, so a
    misspelt ``model.overrides`` key would train the un-overridden model without a word.

    Args:
        model: the preset name (for the message).
        config_cls: the config class the overrides are passed to.
        overrides: the override fields.

    Raises:
        ValueError: naming each unknown key, the closest valid names and the fix (two lines);
            the fields of ``config_cls`` are listed only for a key that none is close to.
    """
    known = config_keys(config_cls)
    unknown = [key for key in overrides if key not in known]
    if not unknown:
        return
    # Suggest among the class's own constructor fields first (the others are rarely meant):
    # those of every class above PretrainedConfig (fot's FLA wrappers take **kwargs only)
    own_fields: set[str] = set()
    for klass in config_cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not issubclass(klass, PretrainedConfig) or klass is PretrainedConfig:
            continue
        params = inspect.signature(init).parameters.values()
        own_fields.update(
            p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )
    own = sorted(k for k in own_fields if k != "self" and not k.startswith("_"))
    hints, fixes = {}, []
    for key in unknown:
        close = difflib.get_close_matches(key, own, n=3, cutoff=0.6) or difflib.get_close_matches(
            key, sorted(known - _CLASSIFICATION_KEYS), n=3, cutoff=0.6
        )
        value = overrides[key]
        hints[f"{key}={value!r}"] = (
            f"did you mean {' or '.join(map(repr, close))}?" if close else "no field is close"
        )
        if close:
            fixes.append((close[0], value))
    name = config_cls.__name__
    if len(unknown) == 1:
        [(given, hint)] = hints.items()
        message = (
            f"unknown model override {given} for model {model!r} ({name} would store it and "
            f"ignore it): {hint}"
        )
    else:
        message = (
            f"unknown model overrides for model {model!r} ({name} would store them and ignore "
            "them): " + ", ".join(f"{given} ({hint})" for given, hint in hints.items())
        )
    if fixes:
        train_py = " ".join(f"+model.overrides.{key}={value!r}" for key, value in fixes)
        api = ", ".join(f"{key}={value!r}" for key, value in fixes)
        message += (
            f"\nFix: `python train.py {train_py}` or `fot.presets.config({model!r}, size, {api})`"
        )
    if len(fixes) < len(unknown):  # nothing close to guess from: every field
        message += f"\n{name} fields: {', '.join(own)}"
    raise ValueError(message)


# Types an override is checked against (fields annotated with other types are left to the
# config class).
_PLAIN_TYPES = (bool, int, float, str, type(None))
# Fields whose values fot checks itself with their own message (fla_baselines._check_mlp_widths:
# FLA annotates hidden_ratio as an int, but a float width factor works).
_OWN_CHECKS = frozenset({"hidden_ratio", "mamba_hidden_ratio", "intermediate_size"})


def _plain_field_types(config_cls: type[PretrainedConfig]) -> dict[str, tuple[type, ...]]:
    """``{field: allowed types}`` of the ``__init__`` parameters of ``config_cls`` (and its
    bases) annotated with bool, int, float, str or None only (``int | None``); a parameter
    without annotation takes the type of its default where that is one of them."""
    fields: dict[str, tuple[type, ...]] = {}
    for klass in reversed(config_cls.__mro__):
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # an annotation that does not resolve: leave its fields unchecked
            hints = {}
        for param in list(inspect.signature(init).parameters.values())[1:]:
            if param.name.startswith("_") or param.kind is not param.POSITIONAL_OR_KEYWORD:
                continue  # (a private argument of fot's subclass, **kwargs)
            hint = hints.get(param.name, param.annotation)
            if hint is inspect.Parameter.empty:
                hint = type(param.default)
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            allowed = typing.get_args(hint) if union else (hint,)
            if all(t in _PLAIN_TYPES for t in allowed):
                fields[param.name] = allowed
            else:
                fields.pop(param.name, None)
    return fields


def _of_type(value: Any, allowed: tuple[type, ...]) -> bool:
    """Whether ``value`` is of one of ``allowed`` (an int is a float; a bool is no number)."""
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    return isinstance(value, tuple(t for t in allowed if t is not bool))


def check_override_types(
    model: str, preset: PretrainedConfig, overrides: Mapping[str, Any]
) -> None:
    """Refuse an override of a type its field does not take (FLA baselines' configs).

    FLA's config classes store what they are given: ``use_short_conv="no"`` trained with a
    short convolution (a word is true), ``num_hidden_layers=2.5`` or ``norm_eps="abc"`` failed
    with a traceback deep in the model. :class:`FoTConfig` checks its own fields.

    Args:
        model: the preset name (for the message).
        preset: the preset's config without overrides; a field may also take the type of
            its value there (None where the preset sets None).
        overrides: the override fields (their keys already checked).

    Raises:
        ValueError: naming the field, the value, the type it takes and an override that works.
    """
    fields = _plain_field_types(type(preset))
    for key, value in overrides.items():
        allowed = fields.get(key)
        if allowed is None or key in _OWN_CHECKS:
            continue
        current = getattr(preset, key, None)
        # the type the preset's value has after FLA's __init__ (Samba's time_step_rank,
        # annotated str for its "auto", becomes an int); no token id is also fine
        allowed = (*allowed, type(current))
        if key.endswith("_token_id"):
            allowed = (*allowed, type(None))
        if _of_type(value, allowed):
            continue
        names = {bool: "true or false", int: "an int", float: "a number", str: "a string"}
        kinds = list(dict.fromkeys(names[t] for t in allowed if t in names))
        kinds += ["null"] if type(None) in allowed else []
        example = current if isinstance(current, str) else json.dumps(current, default=str)
        raise ValueError(
            f"model override {key}={value!r} for model {model!r}: {type(preset).__name__}.{key} "
            f"takes {' or '.join(kinds)}; e.g. +model.overrides.{key}={example} (the preset's value)"
        )


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


__all__ = [
    "MODELS",
    "SIZES",
    "build_model",
    "check_override_keys",
    "check_override_types",
    "config",
    "config_keys",
    "count_params",
    "read_overrides",
]
