"""fot: pretraining framework for Forgetting Transformer (FoT) language models."""

from pathlib import Path as _Path

from fot import _source_layout

_source_layout.install(_Path(__file__).resolve().parent)

__version__ = "0.1.0"
