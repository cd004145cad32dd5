"""FoT model family: config, modeling, generation cache and FLA baselines."""

from .cache import FoTCache, FoTLayerCache
from .configuration_fot import FoTConfig
from .modeling_fot import FoTForCausalLM, FoTModel, FoTPreTrainedModel

__all__ = [
    "FoTCache",
    "FoTConfig",
    "FoTForCausalLM",
    "FoTLayerCache",
    "FoTModel",
    "FoTPreTrainedModel",
]
