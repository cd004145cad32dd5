"""``train.py`` with one rank held back, for ``test_train.py``'s ``parallel.timeout_s`` tests.

``SLOW_AT=start``: rank 1 starts train.py ``SLOW_S`` seconds late, so the others wait for it
to join the process group. ``SLOW_AT=checkpoint:N``: rank 0's ``N``-th checkpoint write (its
model.pt) takes ``SLOW_S`` seconds longer, as on a slow file system, while the other ranks
wait for it in the collective after the write.

Usage: ``SLOW_AT=checkpoint:1 SLOW_S=120 python tests/slow_rank.py <train.py overrides>``
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
point, _, nth = os.environ["SLOW_AT"].partition(":")
slow_s = float(os.environ["SLOW_S"])
rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))

if point == "start" and rank == 1:
    time.sleep(slow_s)
elif point == "checkpoint" and rank == 0:
    import fot.training.checkpoint as ckpt

    save = ckpt._save
    writes = 0

    def _save(obj: object, path: Path) -> None:
        global writes
        if path.name == "model.pt":
            writes += 1
            if writes == int(nth):
                time.sleep(slow_s)
        save(obj, path)

    ckpt._save = _save

sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
