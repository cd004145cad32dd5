"""Export a model as a Hugging Face checkpoint folder.

The folder holds ``config.json`` (with ``auto_map``), safetensors weights, a GPT-2 tokenizer and
two tiny remote-code modules that re-export the classes from the installed ``fot`` package, so
both of these work (with fot installed)::

    AutoModelForCausalLM.from_pretrained(dir)                          # after `import fot`
    AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)  # without importing fot
    lm_eval --model hf --model_args pretrained=dir,trust_remote_code=True ...
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import PreTrainedModel

_CONFIG_MODULE = "configuration_fot"
_MODEL_MODULE = "modeling_fot"

_SHIM_HEADER = '''"""Remote-code entry point written by fot.export: the classes live in the installed `fot`
package (pip install fot); this file only re-exports them for `trust_remote_code=True`."""

'''


def _class_path(cls: type) -> tuple[str, str]:
    """``(module, name)`` under which ``cls`` can be imported again."""
    module = cls.__module__
    if module.startswith("fot.models.fla_baselines"):
        module = "fot.models.fla_baselines"  # lazily created wrapper classes live here
    return module, cls.__name__


def export_hf(
    model: PreTrainedModel,
    path: str | os.PathLike,
    *,
    tokenizer: bool = True,
    max_shard_size: str = "5GB",
) -> Path:
    """Write ``model`` as an HF checkpoint folder loadable by ``AutoModelForCausalLM``.

    Args:
        model: a :class:`fot.FoTForCausalLM` (or a baseline from :func:`fot.presets.build_model`).
        path: output folder (created if missing).
        tokenizer: also write the GPT-2 tokenizer (``fot.tokenizer.save_hf_tokenizer``).
        max_shard_size: passed to ``save_pretrained``.

    Returns:
        The folder path.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"export_hf needs a transformers PreTrainedModel, got {type(model).__name__}; unwrap "
            "DDP/FSDP/compile wrappers first (e.g. model.module)"
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config_module, config_name = _class_path(type(model.config))
    model_module, model_name = _class_path(type(model))

    register = ""
    if model_module == "fot.models.fla_baselines":
        # FLA registers its own classes with the Auto classes; put the fot wrappers first.
        register = "from fot.models.fla_baselines import register_auto_classes\n\nregister_auto_classes()\n"
    (out / f"{_CONFIG_MODULE}.py").write_text(
        _SHIM_HEADER
        + f"from {config_module} import {config_name}\n{register}\n"
        + f'__all__ = ["{config_name}"]\n'
    )
    (out / f"{_MODEL_MODULE}.py").write_text(
        _SHIM_HEADER + f'from {model_module} import {model_name}\n\n__all__ = ["{model_name}"]\n'
    )
    auto_map = {
        "AutoConfig": f"{_CONFIG_MODULE}.{config_name}",
        "AutoModelForCausalLM": f"{_MODEL_MODULE}.{model_name}",
    }
    previous = getattr(model.config, "auto_map", None)
    model.config.auto_map = auto_map
    try:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    finally:
        if previous is None:
            del model.config.auto_map
        else:
            model.config.auto_map = previous
    if tokenizer:
        from fot.tokenizer import save_hf_tokenizer

        max_len = getattr(model.config, "max_position_embeddings", None)
        save_hf_tokenizer(out, model_max_length=max_len)
    return out


__all__ = ["export_hf"]
