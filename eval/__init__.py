"""Evaluation of FoT (and any Hugging Face causal LM) checkpoints (imported as ``fot.eval``).

Commands (``python -m fot.eval <command> --help``):

* ``per-token-loss`` -- L(i) at every position, P(l) and horizon averages (:mod:`.per_token_loss`).
* ``needle`` -- needle in a haystack ("easy"/"standard") and passkey retrieval (:mod:`.needle`).
* ``forgetting-curve`` -- copy vs language-model accuracy over length (:mod:`.forgetting_curve`).
* ``lm-eval`` -- the paper's zero-shot suite through lm-evaluation-harness (:mod:`.lm_eval_adapter`).
* ``longbench`` -- the paper's 14 English LongBench tasks (:mod:`.longbench`).
* ``gates`` -- forget-gate matrix and attention maps of chosen layers/heads (:mod:`.gates`).

Submodules are imported lazily so that ``import fot.eval`` stays cheap.
"""

from __future__ import annotations

import os
import sys

SCRIPT = "fot-eval"
"""The console script's name (``[project.scripts]`` of ``pyproject.toml``)."""


def program_name() -> str:
    """The command the user ran, as messages name it: ``fot-eval`` when the process is the
    console script (its ``sys.argv[0]`` is the script), else ``python -m fot.eval`` (run as a
    module, or called from Python)."""
    started_as = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return SCRIPT if started_as == SCRIPT else "python -m fot.eval"


__all__ = [
    "SCRIPT",
    "common",
    "forgetting_curve",
    "gates",
    "longbench",
    "metrics",
    "needle",
    "per_token_loss",
    "program_name",
]
