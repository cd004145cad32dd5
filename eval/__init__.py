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

__all__ = [
    "common",
    "forgetting_curve",
    "gates",
    "longbench",
    "metrics",
    "needle",
    "per_token_loss",
]
