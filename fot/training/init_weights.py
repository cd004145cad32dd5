"""``init_from=PATH``: start a new training run from trained weights instead of random ones.

``PATH`` is any of

- a training checkpoint of fot (``<run>/checkpoints/step_<n>``): its ``model.pt``, exact;
- an HF folder of a fot model (a run's ``<run>/hf``, the output of ``python -m fot.convert``,
  or any ``save_pretrained`` of a model that :mod:`fot.presets` builds);
- a checkpoint of the paper's code (zhixuan-lin/forgetting-transformer: FoX, Transformer,
  DeltaNet, HGRN2, Mamba-2), converted as :func:`fot.convert.from_paper` does, or of FLA's FoX
  (:func:`fot.convert.from_fla`).

Only the weights are taken: the step, the optimizer's moments, the learning-rate schedule and
the data position start from zero. The model the run's config builds (``model``, ``size``,
``model.overrides``) must compute the same function as the checkpoint's: a field that
differs is named with the override that matches, before any tensor loads. Fields that choose
only how the model is computed (:data:`fot.models.configuration_fot.IMPLEMENTATION_FIELDS`) or
only how it is initialised may differ.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fot.errors import FotError

logger = logging.getLogger(__name__)


class InitFromError(FotError, ValueError):
    """``init_from`` names no usable checkpoint, or one of another model."""


# config.json keys that describe the file, not the model
_META_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "torch_dtype",
        "dtype",
        "model_type",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "max_position_embeddings",
        "id2label",
        "label2id",
        "problem_type",
        "train_length",  # the sequence length it was trained at, recorded for fot.eval
    }
)
# fields that only shape the random initialisation: the loaded weights replace it
_INIT_ONLY_KEYS = frozenset(
    {"initializer_range", "fgate_bias_init", "decay_time_min", "decay_time_max"}
)


@dataclass(frozen=True)
class InitSource:
    """What ``init_from`` points at, read without loading any tensor."""

    path: Path
    kind: str
    """``"checkpoint"`` (fot training checkpoint), ``"hf"`` (HF folder), ``"paper"`` (the
    paper's code) or ``"fla"`` (FLA's FoX)."""
    config: Any
    """The checkpoint model's config (a ``transformers.PretrainedConfig``)."""
    raw_config: dict[str, Any] | None = None
    """The config.json of a checkpoint that is converted (kinds ``"paper"`` and ``"fla"``)."""
    trained_with: str = ""
    """``model=... size=...`` of a training checkpoint's run ('' for other kinds)."""


def read_init_source(path: str | os.PathLike) -> InitSource:
    """Identify the checkpoint ``path`` and read its model config (no tensors).

    ``path`` may be a hub repository id (``owner/name``): it is downloaded into the hub's cache
    (every rank reads the cached copy; the hub's file locks keep concurrent downloads apart).

    Raises:
        InitFromError: not a folder (or a hub id that could not be downloaded), or a folder
            that is none of the kinds above.
    """
    from fot.hub import HubDownloadError, local_folder

    try:
        p = local_folder(str(path))
    except HubDownloadError as err:
        raise InitFromError(f"init_from={path}: {err}") from None
    if not p.is_dir():
        raise InitFromError(
            f"init_from={path} is no folder; pass a training checkpoint "
            "(<run>/checkpoints/step_00001000), an exported model (<run>/hf, python -m "
            "fot.convert's output), a checkpoint folder of the paper's code "
            "or an FLA FoX folder"
        )
    if (p / "trainer.json").is_file() and (p / "model.pt").is_file():
        return _checkpoint_source(p)
    if (p / "config.json").is_file():
        return _hf_source(p)
    if (p / "checkpoints").is_dir() or (p / "hf").is_dir():
        inside = [x for x in (p / "hf", p / "checkpoints") if x.is_dir()]
        raise InitFromError(
            f"init_from={path} is a run folder, not a checkpoint: pass "
            + " or ".join(f"{x}/step_..." if x.name == "checkpoints" else str(x) for x in inside)
        )
    raise InitFromError(
        f"init_from={path} holds neither a training checkpoint (trainer.json and model.pt) "
        "nor a model's config.json: pass <run>/checkpoints/step_..., <run>/hf, or a "
        "downloaded checkpoint folder (whole)"
    )


def _checkpoint_source(p: Path) -> InitSource:
    from omegaconf import OmegaConf

    from fot.models.configuration_fot import IMPLEMENTATION_FIELDS
    from fot.training.trainer import checkpoint_config, model_config_from_train_config

    cfg = checkpoint_config(p)
    trained_with = f"model={cfg.model.name} size={cfg.size.name}"
    overrides = OmegaConf.to_container(cfg.model.overrides) or {}
    # how it was computed (a GPU kernel backend, ...) is not part of the model: not repeated
    overrides = {k: v for k, v in overrides.items() if k not in IMPLEMENTATION_FIELDS}
    if overrides:
        trained_with += " " + " ".join(_override_arg(k, v) for k, v in overrides.items())
    return InitSource(p, "checkpoint", model_config_from_train_config(cfg), None, trained_with)


def _hf_source(p: Path) -> InitSource:
    from fot.convert import (
        FLA_MODEL_TYPE,
        PAPER_MODEL_TYPES,
        fot_config_from_fla,
        fot_config_from_paper,
    )

    try:
        raw = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InitFromError(f"init_from={p}: config.json is not valid JSON ({err})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type in PAPER_MODEL_TYPES:
        return InitSource(p, "paper", fot_config_from_paper(raw), raw)
    if model_type == FLA_MODEL_TYPE:
        return InitSource(p, "fla", fot_config_from_fla(raw), raw)
    from transformers import AutoConfig

    import fot  # noqa: F401 - registers model_type "fot"

    if model_type != "fot":
        from fot.models.fla_baselines import register_auto_classes

        # FLA missing or unusable here: the error below names the model type
        with contextlib.suppress(ImportError):
            register_auto_classes()
    try:
        config = AutoConfig.from_pretrained(str(p))
    except (ValueError, KeyError, OSError) as err:
        raise InitFromError(
            f"init_from={p}: its config.json (model_type {model_type!r}) is not of a model "
            f"fot trains ({str(err)[:200]}); pass a fot checkpoint or export, or a checkpoint "
            "of the paper's code"
        ) from None
    if not str(getattr(config, "model_type", "")).startswith("fot"):  # fot, fot_mamba2, ...
        raise InitFromError(
            f"init_from={p} is a {type(config).__name__} (model_type {model_type!r}), not a "
            "model fot trains: pass a fot checkpoint or export, or a checkpoint of the paper's "
            "code"
        )
    return InitSource(p, "hf", config)


TOKENIZER_FOLDER = "tokenizer"
"""The run folder's copy of the tokenizer of the weights it started from, where that is not
fot's GPT-2 tokenizer (:func:`own_tokenizer`); the run's exports carry it instead of GPT-2's."""


def run_tokenizer(run: str | os.PathLike) -> Path | None:
    """The run folder ``run``'s tokenizer copy (:data:`TOKENIZER_FOLDER`), for reading: the
    folder itself, or where a start killed while replacing it left it set aside
    (``.tokenizer.old-{host}.{pid}``, always whole; the run's next resume puts it back), that
    copy, with a warning. ``None`` where the run has none (its exports carry GPT-2's)."""
    from fot.staging import ended_writers

    folder = Path(run) / TOKENIZER_FOLDER
    if folder.is_dir():
        return folder
    asides = ended_writers(Path(run), f".{TOKENIZER_FOLDER}.old-")
    if not asides:
        return None
    logger.warning(
        "the run's tokenizer %s is missing: reading the copy %s that a start of the run (%s) "
        "set aside to replace it and did not finish (killed?); resuming the run puts it back",
        folder,
        asides[-1].path,
        asides[-1].writer(),
    )
    return asides[-1].path


def own_tokenizer(source: InitSource) -> Path | None:
    """The folder with the tokenizer of ``source``'s model, where that is not fot's GPT-2
    tokenizer (which a run's export writes otherwise): an FLA model's own (``python -m
    fot.convert`` keeps it), or the one a training checkpoint's run carried
    (:data:`TOKENIZER_FOLDER`). ``None`` for GPT-2's, or a folder without tokenizer files.

    Raises:
        InitFromError: the folder's tokenizer files do not load.
    """
    from transformers import AutoTokenizer

    from fot.convert import TOKENIZER_FILES, copy_tokenizer
    from fot.tokenizer import bpe_files, unreadable_tokenizer_file

    if source.kind == "checkpoint":
        return run_tokenizer(source.path.parent.parent)
    if not any((source.path / name).is_file() for name in TOKENIZER_FILES):
        return None
    gpt2 = bpe_files()  # a fot export's files are GPT-2's own: no need to load them
    if not (source.path / "tokenizer.json").exists() and all(
        (source.path / name).is_file()
        and (source.path / name).read_bytes() == gpt2[ours].read_bytes()
        for name, ours in (("vocab.json", "encoder.json"), ("merges.txt", "vocab.bpe"))
    ):
        return None
    try:
        # from its files alone: beside them, transformers reads the model's config.json and
        # warns that a model of another type is instantiated
        with tempfile.TemporaryDirectory() as alone:
            copy_tokenizer(source.path, alone, "none")
            vocab = AutoTokenizer.from_pretrained(alone).get_vocab()
    except Exception as err:  # a tokenizer library has many ways to fail
        unreadable = unreadable_tokenizer_file(source.path)
        if unreadable is None:
            what, files = f"its tokenizer files do not load ({str(err)[:200]})", "them"
        else:
            name, reason = unreadable
            what, files = f"its {name} cannot be read ({reason}): it is cut short or damaged", name
        raise InitFromError(
            f"init_from={source.path}: {what}; copy {files} from where the model came from again"
        ) from None
    return None if vocab == json.loads(gpt2["encoder.json"].read_text()) else source.path


def _comparable(config: Any) -> dict[str, Any]:
    """The fields of ``config`` that decide what its model computes, by override key."""
    from transformers import PretrainedConfig

    from fot.models.configuration_fot import IMPLEMENTATION_FIELDS, FoTConfig

    own = set()  # the fields of the model's config classes, not PretrainedConfig's generic ones
    for cls in type(config).__mro__:
        if issubclass(cls, PretrainedConfig) and cls is not PretrainedConfig:
            own.update(inspect.signature(cls.__init__).parameters)
    fields = {
        k: v
        for k, v in config.to_dict().items()
        if k in own
        and k not in _META_KEYS
        and k not in _INIT_ONLY_KEYS
        and k not in IMPLEMENTATION_FIELDS
        and not k.startswith(("fuse_", "_"))
    }
    if isinstance(config, FoTConfig):
        # hidden_ratio and intermediate_size both give the MLP width; the vocabulary padding
        # matters as the rows it makes
        for k in ("hidden_ratio", "pad_vocab_multiple", "num_kv_heads", "head_dim"):
            fields.pop(k, None)
        fields["intermediate_size"] = config.mlp_size
        fields["num_kv_heads"] = config.kv_heads
        fields["padded_vocab_size"] = config.padded_vocab_size
        if config.fgate_type == "fixed":  # they describe the gate buffer the weights hold
            fields["decay_time_min"] = config.decay_time_min
            fields["decay_time_max"] = config.decay_time_max
    return fields


def _differing(theirs: Any, ours: Any) -> dict[str, tuple[Any, Any]]:
    """``{field: (theirs, ours)}`` for the fields of :func:`_comparable` that differ."""
    if type(theirs).__name__ != type(ours).__name__:
        return {"model class": (type(theirs).__name__, type(ours).__name__)}
    a, b = _comparable(theirs), _comparable(ours)
    # a setting of a part neither model has (the RoPE base without RoPE) changes nothing
    for part, setting in (("use_rope", "rope_theta"), ("qk_norm", "qk_norm_eps")):
        if part in a and not (a[part] or b.get(part)):
            a.pop(setting, None)
            b.pop(setting, None)
    if "mamba_hidden_ratio" in a:  # a Samba: its MLP ratios matter as the widths they build
        from fot.models.fla_baselines import samba_mlp_widths

        if samba_mlp_widths(theirs) == samba_mlp_widths(ours):
            for k in ("hidden_ratio", "mamba_hidden_ratio"):
                a.pop(k, None)
                b.pop(k, None)
    return {
        k: (a.get(k, "unset"), b.get(k, "unset"))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    }


def model_differences(source: InitSource, config: Any) -> list[str]:
    """What differs between the model of ``source`` and the one ``config`` describes.

    Returns:
        One ``field=<checkpoint's> (init_from) vs <this run's> (this run)`` line per differing
        field; empty when the checkpoint's weights compute the same function in the run's model.
    """
    return [
        f"{k}={a} (init_from) vs {b} (this run)"
        for k, (a, b) in _differing(source.config, config).items()
    ]


def _hydra_value(value: Any) -> str:
    """``value`` as a Hydra override writes it (``None`` is ``null``: Hydra reads ``None`` as
    the string "None")."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _override_arg(key: str, value: Any) -> str:
    """The command-line argument ``++model.overrides.<key>=<value>``, in single quotes where
    the value is a list or mapping (the shell would expand its brackets and braces)."""
    arg = f"++model.overrides.{key}={_hydra_value(value)}"
    return f"'{arg}'" if isinstance(value, (list, tuple, dict)) else arg


def _overrides(diff: dict[str, tuple[Any, Any]]) -> list[str]:
    """The ``model.overrides.<field>=<checkpoint's value>`` that remove the differences
    ``diff`` (padded_vocab_size follows from vocab_size and pad_vocab_multiple)."""
    heads = diff.get("num_heads", (None,))[0]
    out = [
        _override_arg(k, a)
        for k, (a, _) in diff.items()
        # padded_vocab_size is derived; num_kv_heads follows num_heads unless it is set apart
        if k != "padded_vocab_size" and not (k == "num_kv_heads" and a == heads)
    ]
    if list(diff) == ["padded_vocab_size"]:
        out.append("++model.overrides.pad_vocab_multiple=<a divisor of its padded_vocab_size>")
    return out


def _matching_preset(config: Any) -> str | None:
    """``model=<name> size=<size>`` (plus a vocab_size override where needed) of the preset
    that builds the model of ``config`` (a FoT or an FLA baseline's), if one does."""
    from fot import presets
    from fot.models.configuration_fot import FoTConfig
    from fot.models.fla_baselines import FLA_MODELS, _fla_name

    if isinstance(config, FoTConfig):
        names = [name for name in presets.MODELS if name not in FLA_MODELS]
    else:  # an FLA baseline's (FLA is imported: its config was read), or no model fot trains
        try:
            names = [_fla_name(config)]
        except ValueError:
            return None
    for name in names:
        for size in presets.SIZES:
            diff = _differing(config, presets.config(name, size))
            rest = {k: v for k, v in diff.items() if k not in ("vocab_size", "padded_vocab_size")}
            if not rest:
                return " ".join([f"model={name}", f"size={size}", *_overrides(diff)])
    return None


def check_init_source(source: InitSource, config: Any) -> None:
    """Refuse ``source`` when its model is not the one ``config`` builds.

    Raises:
        InitFromError: names each differing field and the settings that build the
            checkpoint's model.
    """
    diff = _differing(source.config, config)
    if not diff:
        return
    if source.trained_with:
        fix = f"train with the settings it was trained with: {source.trained_with}"
    elif preset := _matching_preset(source.config):
        fix = f"train with {preset}"
    elif "model class" in diff:
        fix = "pick the model=... it was trained as"
    else:
        fix = "set its values: " + " ".join(_overrides(diff))
    raise InitFromError(
        f"init_from={source.path} is a model other than the one this run builds: "
        + "; ".join(model_differences(source, config))
        + f". To start from its weights, {fix}"
    )


def check_init_files(source: InitSource) -> None:
    """Open the weight files of ``source`` without reading their tensors, so that a file cut
    short is refused before the run makes its folder (:func:`load_init_weights` reads them).

    Raises:
        fot.training.checkpoint.CorruptCheckpointError: a training checkpoint's ``model.pt``.
        fot.export.WeightFilesError: another kind's weight file.
    """
    if source.kind == "checkpoint":
        from fot.training.checkpoint import check_model_file

        check_model_file(source.path)
    else:
        from fot.export import check_weight_files

        check_weight_files(source.path)


def load_init_weights(source: InitSource, model: nn.Module) -> None:
    """Copy the weights of ``source`` into ``model`` (unwrapped, before DDP/FSDP).

    Every rank reads the full weights on the CPU (the folder must be visible to all ranks).

    Raises:
        InitFromError: a weight is missing, left over or of another shape (the files do not
            belong to their config), or the files cannot be read.
    """
    from fot.export import read_weight_files

    if source.kind == "checkpoint":
        from fot.training.checkpoint import read_model_state

        state = read_model_state(source.path)
    elif source.kind in ("paper", "fla"):
        from fot.convert import state_dict_from_fla, state_dict_from_paper

        assert source.raw_config is not None
        to_state = state_dict_from_paper if source.kind == "paper" else state_dict_from_fla
        state = to_state(read_weight_files(source.path), source.raw_config, source.config)
    else:
        state = read_weight_files(source.path)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    wrong = sorted(
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in set(own) & set(state)
        if state[k].shape != own[k].shape
    )
    problems = [
        f"{what}: {names[:4]}{' ...' if len(names) > 4 else ''}"
        for what, names in (
            ("missing", missing),
            ("not in this model", extra),
            ("of another shape (init_from vs this run)", wrong),
        )
        if names
    ]
    if problems and source.kind == "checkpoint":
        from fot.models.fla_baselines import older_samba_widths

        if older_samba_widths(source.config, {k: v.shape for k, v in state.items()}):
            raise InitFromError(
                f"init_from={source.path} holds a Samba of an older fot, whose MLPs after Mamba "
                f"layers have FLA's width (hidden_ratio={source.config.hidden_ratio}); this fot "
                f"builds them with mamba_hidden_ratio={source.config.mamba_hidden_ratio}. Export "
                "it with the fot version that wrote it (python -m fot.export CHECKPOINT OUT) "
                "and pass that export as init_from, with ++model.overrides.mamba_hidden_ratio=null"
            )
    if problems:
        raise InitFromError(
            f"init_from={source.path}: its weights do not fit the model of its own config "
            f"({'; '.join(problems)}); the folder mixes files of different models: copy or "
            "export it again"
        )
    with torch.no_grad():
        for key, tensor in own.items():
            tensor.copy_(state[key])
