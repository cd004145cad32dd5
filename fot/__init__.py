"""fot: pretraining framework for Forgetting Transformer (FoT) language models."""

from pathlib import Path as _Path

from fot import _source_layout

_source_layout.install(_Path(__file__).resolve().parent)

from fot.mkl_math import resolve_vml_dispatch  # noqa: E402

resolve_vml_dispatch()  # before any op of many threads: see fot/mkl_math.py

from transformers import AutoConfig as _AutoConfig  # noqa: E402
from transformers import AutoModel as _AutoModel  # noqa: E402
from transformers import AutoModelForCausalLM as _AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as _MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from fot import presets, tokenizer  # noqa: E402
from fot.models import FoTConfig, FoTForCausalLM, FoTModel  # noqa: E402

# `import fot` makes AutoConfig / AutoModelForCausalLM know model_type "fot".
_AutoConfig.register(FoTConfig.model_type, FoTConfig, exist_ok=True)
_AutoModel.register(FoTConfig, FoTModel, exist_ok=True)
_AutoModelForCausalLM.register(FoTConfig, FoTForCausalLM, exist_ok=True)
# transformers decides by this table of names whether a model is a causal LM: HF's Trainer
# shifts the labels for its label-smoothing loss only then, text-generation pipelines and
# lm-eval check it too. Registering the class above does not add the name.
_MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(FoTConfig.model_type, FoTForCausalLM.__name__)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``fot.export`` is imported on first use, not by ``import fot``: ``python -m fot.export``
    then runs a module that is not imported yet (runpy warns about one that is)."""
    if name == "export":
        import importlib

        return importlib.import_module("fot.export")
    raise AttributeError(f"module 'fot' has no attribute {name!r}")


__all__ = [
    "FoTConfig",
    "FoTForCausalLM",
    "FoTModel",
    "__version__",
    "export",
    "presets",
    "tokenizer",
]
