"""Tasks that srun starts without torchrun: torchrun's variables from Slurm's (fot.slurm).

The two-process training run under these variables is in test_train.py
(``test_two_processes_equal_one``, launcher ``srun``).
"""

from __future__ import annotations

import pytest

from fot.slurm import PORT_BASE, PORT_SPAN, SlurmEnvironmentError, first_host, torchrun_variables


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("gpu017", "gpu017"),
        ("gpu[003-006,010]", "gpu003"),
        ("gpu[010,003-006]", "gpu010"),
        ("gpu[7-8],cpu1", "gpu7"),
        ("cpu1,gpu[7-8]", "cpu1"),
        ("rack[1-2]-n[07-08]", "rack1-n07"),
        ("node-a.cluster.org", "node-a.cluster.org"),
    ],
)
def test_first_host_of_a_slurm_host_list(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_an_unreadable_host_list_names_master_addr() -> None:
    with pytest.raises(SlurmEnvironmentError, match=r"'gpu\[1-2'; set MASTER_ADDR"):
        first_host("gpu[1-2")


def _srun(procid: int, localid: int, **more: str) -> dict[str, str]:
    """What srun sets for task ``procid`` of 8 on two nodes (4 per node), job 4321."""
    return {
        "SLURM_JOB_ID": "4321",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_STEP_NODELIST": "gpu[012-013]",
        "SLURM_JOB_NODELIST": "gpu[011-013]",
        **more,
    }


def test_srun_tasks_get_torchrun_variables() -> None:
    # task 6 is the third on the second node; every GPU of the node is visible
    assert torchrun_variables(_srun(6, 2), visible_gpus=4) == {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "MASTER_ADDR": "gpu012",  # the step's first node, not the job's
        "MASTER_PORT": str(PORT_BASE + 4321),
    }
    # srun --gpus-per-task=1: each task sees its own GPU as device 0
    assert torchrun_variables(_srun(6, 2), visible_gpus=1)["LOCAL_RANK"] == "0"


def test_steps_of_one_job_that_run_at_once_get_their_own_port() -> None:
    """`srun ... &` twice in one allocation: both steps' first node is the same, and with the
    port of the job id the second step's rendezvous found the first one's port taken."""
    ports = {
        torchrun_variables(_srun(0, 0, SLURM_STEP_ID=str(step)), visible_gpus=4)["MASTER_PORT"]
        for step in range(PORT_SPAN)
    }
    assert len(ports) == PORT_SPAN
    assert {int(p) for p in ports} == set(range(PORT_BASE, PORT_BASE + PORT_SPAN))
    step_3 = _srun(0, 0, SLURM_STEP_ID="3")
    assert torchrun_variables(step_3, visible_gpus=4)["MASTER_PORT"] == str(
        PORT_BASE + (4321 + 3 * 1009) % PORT_SPAN
    )


def test_variables_already_set_are_kept() -> None:
    env = _srun(1, 1, MASTER_ADDR="10.0.0.5", MASTER_PORT="29400")
    assert torchrun_variables(env, visible_gpus=4) == {
        "RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
    }


@pytest.mark.parametrize(
    "env",
    [
        {},  # no Slurm
        {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8", "SLURM_PROCID": "0"},  # the batch script
        {**_srun(0, 0), "SLURM_STEP_NUM_TASKS": "1"},  # srun with one task
        {**_srun(3, 3), "WORLD_SIZE": "8", "RANK": "3"},  # srun torchrun: torchrun's own
    ],
)
def test_nothing_to_do_outside_a_step_of_several_tasks(env: dict[str, str]) -> None:
    assert torchrun_variables(env, visible_gpus=8) == {}


def test_a_bad_task_variable_is_named() -> None:
    with pytest.raises(SlurmEnvironmentError, match=r"SLURM_PROCID='x': srun sets it"):
        torchrun_variables(_srun(0, 0, SLURM_PROCID="x"), visible_gpus=0)
    with pytest.raises(SlurmEnvironmentError, match=r"SLURM_PROCID=8 is not a task of the 8"):
        torchrun_variables(_srun(8, 0), visible_gpus=0)
    env = _srun(0, 0)
    del env["SLURM_STEP_NODELIST"], env["SLURM_JOB_NODELIST"]
    with pytest.raises(SlurmEnvironmentError, match=r"set MASTER_ADDR"):
        torchrun_variables(env, visible_gpus=0)
