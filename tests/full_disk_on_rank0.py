"""``train.py`` with a full disk on rank 0 only, for ``test_train.py``: its ``POINT``-th write
of ``FULL_DISK_AT`` (``checkpoint:N`` the checkpoint's model.pt, ``metrics:N`` a metrics.jsonl
record) fails with ENOSPC. Rank 0 then stays alive ``LINGER_S`` seconds after its error, as a
process does for NCCL, which (unlike gloo) never tells the others that a peer has gone.

Usage: ``FULL_DISK_AT=checkpoint:2 python tests/full_disk_on_rank0.py <train.py overrides>``
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
point, nth = os.environ["FULL_DISK_AT"].split(":")
rank0 = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0
calls = 0


def full(path: object) -> bool:
    """Whether this write fails (rank 0's ``nth`` one)."""
    global calls
    calls += 1
    return calls == int(nth)


if rank0 and point == "checkpoint":
    import fot.training.checkpoint as ckpt

    save = ckpt._save

    def _save(obj: object, path: Path) -> None:
        if path.name == "model.pt" and full(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        save(obj, path)

    ckpt._save = _save
elif rank0 and point == "metrics":
    import fot.training.metrics as metrics

    log = metrics.MetricsLogger.log

    class _FullFile:
        def __init__(self, f: object) -> None:
            self.f = f

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def fileno(self) -> int:
            return self.f.fileno()

        def close(self) -> None:
            self.f.close()

    def _log(self: metrics.MetricsLogger, record: dict) -> None:
        if self.enabled and full(self.path):
            self._file = _FullFile(self._file)
        log(self, record)

    metrics.MetricsLogger.log = _log

sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    if rank0:
        sys.stderr.flush()
        time.sleep(float(os.environ.get("LINGER_S", "0")))
