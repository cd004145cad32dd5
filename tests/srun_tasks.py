"""The environment of the tasks of a Slurm job step on this host, for tests that start
``python train.py`` / ``python -m fot.eval`` as srun would (no Slurm here)."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port nothing listens on now (for a rendezvous on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def srun_environments(tasks: int, **more: str) -> list[dict[str, str]]:
    """``os.environ`` plus what srun sets for each of ``tasks`` tasks on one node
    (``localhost``), with a free ``MASTER_PORT`` (the job id's port may be taken here)."""
    step = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
        **more,
    }
    return [
        {**os.environ, **step, "SLURM_PROCID": str(t), "SLURM_LOCALID": str(t)}
        for t in range(tasks)
    ]
