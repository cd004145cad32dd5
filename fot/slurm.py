"""Processes that Slurm's ``srun`` started as the tasks of one job step, without torchrun.

``srun --ntasks-per-node=8 python train.py ...`` starts eight processes that torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) do not
describe; each would train alone, all into the same run folder. :func:`torchrun_variables`
derives those variables from the ones ``srun`` sets for each task, so that ``train.py`` and
``fot.eval`` join one process group as under torchrun. ``srun torchrun ...`` (one task per
node running torchrun) needs none of this: torchrun sets ``WORLD_SIZE`` for its processes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from fot.errors import FotError

PORT_BASE = 15000
"""``MASTER_PORT`` of a Slurm step is ``PORT_BASE + (job id + PORT_STEP_STRIDE * step id) %
PORT_SPAN`` unless set: the steps of one job that run at once (``srun ... &``) on the same
first node get different ports."""
PORT_SPAN = 10000
PORT_STEP_STRIDE = 1009
"""A prime: the first ``PORT_SPAN`` steps of a job get ``PORT_SPAN`` different ports."""


class SlurmEnvironmentError(FotError, ValueError):
    """Slurm's task variables that do not describe a job step."""


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list, e.g. ``"gpu[003-006,010],cpu1"`` -> ``"gpu003"``
    and ``"rack[1-2]-n[07-08]"`` -> ``"rack1-n07"`` (zero padding kept)."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first host expression: up to a top-level comma
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    host = nodelist[:end].strip()
    # each bracket group [a-b,c,...] stands for its first number, a
    host = re.sub(r"\[([^\]\-,]*)[^\]]*\]", lambda m: m.group(1), host)
    if not host or any(ch in host for ch in "[],"):
        raise SlurmEnvironmentError(
            f"cannot read the first host of the Slurm host list {nodelist!r}; set MASTER_ADDR "
            "to the first node's address"
        )
    return host


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SlurmEnvironmentError(
            f"{name}={value!r}: srun sets it to a number for each task; run the command with "
            "srun, or unset SLURM_STEP_NUM_TASKS to run one process"
        ) from None


def torchrun_variables(environ: Mapping[str, str], visible_gpus: int) -> dict[str, str]:
    """torchrun's variables for a process that ``srun`` started as one of several tasks.

    Args:
        environ: the process's environment (``os.environ``).
        visible_gpus: CUDA devices this process sees (``torch.cuda.device_count()``). One
            device with several tasks per node means srun gave each task its own GPU
            (``--gpus-per-task=1``, ``--gpu-bind``): it is device 0 of every task.

    Returns:
        ``RANK`` (``SLURM_PROCID``), ``WORLD_SIZE`` (``SLURM_STEP_NUM_TASKS``), ``LOCAL_RANK``
        (``SLURM_LOCALID``), ``MASTER_ADDR`` (the step's first node) and ``MASTER_PORT``
        (from the job and step ids), each only where the environment does not set it
        already; empty when ``WORLD_SIZE`` is set (torchrun) or the process is not one of
        several srun tasks.

    Raises:
        SlurmEnvironmentError: a task variable that is missing or not a number.
    """
    if "WORLD_SIZE" in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return {}
    tasks = _int(environ, "SLURM_STEP_NUM_TASKS")
    if tasks <= 1:
        return {}
    rank, local_rank = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_LOCALID")
    if not 0 <= rank < tasks:
        raise SlurmEnvironmentError(
            f"SLURM_PROCID={rank} is not a task of the {tasks} in SLURM_STEP_NUM_TASKS"
        )
    found = {
        "RANK": str(rank),
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": str(0 if visible_gpus == 1 else local_rank),
    }
    if "MASTER_ADDR" not in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise SlurmEnvironmentError(
                "srun started this task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST; "
                "set MASTER_ADDR to the first node's address"
            )
        found["MASTER_ADDR"] = first_host(nodelist)
    if "MASTER_PORT" not in environ:
        job = _int(environ, "SLURM_JOB_ID")
        step = environ.get("SLURM_STEP_ID", "")
        step = int(step) if step.isdigit() else 0  # only a port: no reason to stop
        found["MASTER_PORT"] = str(PORT_BASE + (job + PORT_STEP_STRIDE * step) % PORT_SPAN)
    return {k: v for k, v in found.items() if k not in environ}
