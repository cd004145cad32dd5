"""Every ``python -m fot.eval`` command end to end on tiny checkpoints, offline, with resume."""

from __future__ import annotations

import argparse
import csv
import errno
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_helpers import (
    QUESTIONS,
    make_fot_checkpoint,
    make_llama_checkpoint,
    make_trained_fot_checkpoint,
)
from srun_tasks import srun_environments
from zarr_arrays import new_array

from fot.data.prepare import main as prepare
from fot.data.tokens import FILES as TOKEN_FILES
from fot.eval.__main__ import build_parser, cli, main
from fot.eval.common import ResumeMismatchError


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "llama": make_llama_checkpoint(root / "llama"),
        "llama2": make_llama_checkpoint(root / "llama2", seed=1),  # other weights
        "fot": make_trained_fot_checkpoint(root / "fot"),  # the trainer's own export
    }


def _lines(path):
    return path.read_text().splitlines()


def _error_after_progress(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run ``python -m fot.eval ARGV``, which must fail with status 2; its stderr from the
    error line on (after the progress bar)."""
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err
    return err[err.find("python -m fot.eval") :]


def _run_config(out, command):
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["command"] == command
    assert "torch" in cfg["versions"] and "checkpoint" in cfg
    return cfg


def test_bad_checkpoint_and_arguments_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        main(["needle", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        main(["gates", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="'2x'"):
        main(["needle", str(tmp_path / "empty"), "--lengths", "1k,2x", "--out", str(tmp_path)])


def test_help_lists_all_commands(capsys, monkeypatch):
    """``python -m fot.eval --help`` (its ``main``, in this process) lists every command."""
    monkeypatch.setattr(sys, "argv", ["python -m fot.eval"])
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("per-token-loss", "needle", "forgetting-curve", "lm-eval", "longbench", "gates"):
        assert cmd in out


@pytest.mark.parametrize("which", ["llama", "fot"])
def test_per_token_loss_sources_and_resume(ckpts, tmp_path, which):

    from fot.data.tokens import write_token_documents

    ck = str(ckpts[which])

    def per_token_loss(*args: str) -> dict:
        """``per-token-loss`` of the checkpoint on the CPU with ``args``."""
        return main(["per-token-loss", ck, *args, "--device", "cpu"])

    out = tmp_path / "sample"
    s = per_token_loss("--length", "48", "--max-docs", "2", "--out", str(out), "--smooth", "5")
    assert s["num_documents"] == 2 and s["positions"] == 48  # BOS in front for the sample
    assert (out / "per_token_loss.png").stat().st_size > 1000
    loss = np.load(out / "per_token_loss.npz")["loss"]
    assert loss.shape == (48,) and np.isfinite(loss).all()
    _run_config(out, "per-token-loss")
    # Rerun: everything is in state.npz, same numbers.
    s2 = per_token_loss("--length", "48", "--max-docs", "2", "--out", str(out))
    assert s2["mean_loss"] == pytest.approx(s["mean_loss"])
    if which == "fot":
        return
    # zarr rows (LongCrawl64 format): a BOS in front, as the trainer reads them; short arrays
    # rejected.
    rows = np.random.default_rng(0).integers(0, 50000, size=(3, 40)).astype(np.uint16)
    zarr = str(tmp_path / "heldout.zarr")
    arr = new_array(zarr, shape=rows.shape, dtype="uint16", chunks=(1, 40))
    arr[:] = rows
    z = per_token_loss(
        "--data", zarr, "--length", "40", "--out", str(tmp_path / "z"), "--overlay", f"sample={out}"
    )
    assert z["num_documents"] == 3 and z["positions"] == 40
    # the oracle: the trainer's own zarr reader (BOS, then the row) and a plain cross-entropy
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from fot.data.streams import ZarrRowsSource

    inputs, labels = ZarrRowsSource(rows, seq_len=40).read(0, 3)
    model = AutoModelForCausalLM.from_pretrained(ck).float().eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(inputs)).logits.float()
    want = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(labels).reshape(-1)
    )
    assert z["mean_loss"] == pytest.approx(want.item(), abs=1e-5)
    with pytest.raises(ValueError, match="at least 41 tokens"):
        per_token_loss("--data", zarr, "--length", "41", "--out", str(tmp_path / "z2"))
    # token folder: only documents at least --length long.
    write_token_documents(tmp_path / "tok", [rows[0], rows[1][:10], rows[2]])
    t = per_token_loss(
        "--data", str(tmp_path / "tok"), "--length", "20", "--out", str(tmp_path / "t")
    )
    assert t["num_documents"] == 2


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_per_token_loss_under_torchrun_equals_single_process(ckpts, tmp_path, launcher):
    """Two CPU ranks (gloo) split the documents; the all-reduced L(i) is the same. ``srun``:
    two plain processes with the variables srun gives the two tasks of a job step."""
    ck = str(ckpts["llama"])
    common = ["per-token-loss", ck, "--length", "40", "--max-docs", "3", "--device", "cpu"]
    single = main([*common, "--out", str(tmp_path / "one")])
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", "-m", "fot.eval", *common, "--out", str(tmp_path / "two")]  # fmt: skip
        res = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        # rank 0's bar counts its own documents (2 of the 3), and says so
        assert "per-token loss @ 40 (this process's documents; 2 processes): 100%" in res.stderr
        assert "| 2/2 [" in res.stderr, res.stderr[-2000:]
        assert "Loading weights" not in res.stderr  # transformers' bar (stderr is a pipe)
    else:
        cmd = [sys.executable, "-m", "fot.eval", *common, "--out", str(tmp_path / "two")]
        procs = [
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for env in srun_environments(2)
        ]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        assert "srun started 2 tasks without torchrun" in outputs[0]
    a = np.load(tmp_path / "one" / "per_token_loss.npz")
    b = np.load(tmp_path / "two" / "per_token_loss.npz")
    np.testing.assert_array_equal(b["count"], np.full(40, 3))  # every document counted once
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-6)
    assert (tmp_path / "two" / "state_rank1.npz").is_file()
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["num_documents"] == 3
    assert single["num_documents"] == 3
    # rerun in one process (here: to overlay another run): the saved sums are reused as they are;
    # a record of an older fot, which also named the number of processes, is taken as well
    record = tmp_path / "two" / "per_token_loss.resume.json"
    saved = json.loads(record.read_text())
    saved["settings"]["torchrun processes"] = 2
    record.write_text(json.dumps(saved))
    again = main([*common, "--out", str(tmp_path / "two"), "--overlay", f"one={tmp_path / 'one'}"])
    assert again["mean_loss"] == pytest.approx(single["mean_loss"], rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "two").glob("state*")) == ["state.npz"]
    c = np.load(tmp_path / "two" / "per_token_loss.npz")
    np.testing.assert_array_equal(c["count"], b["count"])
    np.testing.assert_array_equal(c["loss"], b["loss"])


SLOW_RANK_1 = """
import os, sys, time
import fot.eval.per_token_loss as ptl

if os.environ["RANK"] == "1":  # held back after the start, while rank 0 waits for the sums
    evaluate = ptl.evaluate_per_token_loss
    ptl.evaluate_per_token_loss = lambda *a, **k: time.sleep(120) or evaluate(*a, **k)
from fot.eval.__main__ import cli
sys.exit(cli(sys.argv[1:], exiting=True))
"""


def test_per_token_loss_under_torchrun_has_a_timeout_named_when_it_runs_out(ckpts, tmp_path):
    """Under torchrun, per-token-loss's process group had torch's fixed timeouts (600 s over
    nccl, 1800 s over gloo) with no option like training's parallel.timeout_s, and a gloo
    timeout ended in a RuntimeError traceback from torch's C++. --timeout-s now sets it, and
    running out is one line naming it and that finished documents are saved; the rerun
    resumes. Oracle: the one-process run of the same documents."""
    ck = str(ckpts["llama"])
    common = ["per-token-loss", ck, "--length", "40", "--max-docs", "3", "--device", "cpu"]
    single = main([*common, "--out", str(tmp_path / "one")])
    script = tmp_path / "slow_rank_1.py"
    script.write_text(SLOW_RANK_1)
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(script), *common, "--timeout-s", "5", "--out", str(out)]  # fmt: skip
    root = str(Path(__file__).resolve().parents[1])  # this checkout's fot, as -m fot.eval's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if "(rank 0 of 2): error:" in x]
    assert len(lines) == 1, res.stderr[-3000:]
    line = lines[0]
    assert "waited longer than --timeout-s 5 for the other processes" in line, line
    assert f"Finished documents are saved in {str(out)!r}" in line
    assert "Traceback" not in res.stderr.split("(rank 0 of 2): error:")[0][-3000:]
    assert (out / "state_rank0.npz").is_file()  # rank 0's 2 documents
    again = main([*common, "--out", str(out)])
    assert again["num_documents"] == 3
    assert again["mean_loss"] == pytest.approx(single["mean_loss"], rel=1e-6)


HOLD_OUT = (
    "import sys\n"
    "from fot.training.checkpoint import RunFolderLock\n"
    "lock = RunFolderLock(sys.argv[1])\n"
    "lock.take()\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)
"""Another run's lock on an --out (the lock that fot.eval takes, fot.eval.common.lock_out), in
a process of its own, held until its stdin closes."""


def _this_checkout_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])  # this checkout's fot, as -m fot.eval's
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


HOLD_NEW_OUT = (
    "import sys\n"
    "import fot\n"
    "from fot.eval.common import lock_out, release_out_locks\n"
    "lock_out(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
    "release_out_locks(failed=True)\n"
)
"""A run of fot.eval that locked its --out as it started (fot.eval.common.lock_out) and fails
once its stdin closes."""


def _hold_out(out: Path, script: str = HOLD_OUT) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, str(out)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_this_checkout_env())  # fmt: skip
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_run_into_the_same_out_is_refused_naming_the_first(
    ckpts, tmp_path, capsys, monkeypatch
) -> None:
    """Two runs into one --out at once (a job submitted twice) both did all the work. The
    second is now refused as the trainer refuses a second run in its folder (its lock,
    .run.lock): before the model loads, naming the first run's pid and host, with nothing
    written; into a new --out too, which the first made to lock it (and which goes again
    where the command fails). A lock left by a killed run does not block the rerun."""
    import socket

    import fot.eval.forgetting_curve as fc
    from fot.training.checkpoint import RUN_LOCK, RunFolderInUseError

    real_load = fc.load_checkpoint
    argv = ["forgetting-curve", str(ckpts["llama"]), "--lengths", "32", "--repeats", "1",
            "--device", "cpu"]  # fmt: skip
    out = tmp_path / "fc"
    out.mkdir()
    first = _hold_out(out)
    try:

        def load_checkpoint(*args, **kwargs):
            raise AssertionError("the model was loaded")

        monkeypatch.setattr(fc, "load_checkpoint", load_checkpoint)
        assert cli([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"python -m fot.eval forgetting-curve: error: {out} is in use by another run (pid "
            f"{first.pid} on {socket.gethostname()}, started "
        ), err
        assert "): two runs into one --out (a job submitted twice) would both do all of its " in err
        assert (
            "Pass another --out, or wait for that run to end (rerun this command then: it " in err
        )
        assert [p.name for p in out.iterdir()] == [RUN_LOCK]  # nothing written
    finally:
        first.kill()  # killed: its lock goes with it, its record stays in the file
        first.wait()
    assert f"pid {first.pid} on" in (out / RUN_LOCK).read_text()
    monkeypatch.setattr(fc, "load_checkpoint", real_load)
    main([*argv, "--out", str(out)])
    assert (out / "summary.json").is_file()
    assert f"pid {os.getpid()} on" in (out / RUN_LOCK).read_text()  # the rerun's record

    # both runs started into a new --out: the first made it to lock it, so the second is
    # refused before its model loads too (it was let through until the first made the folder)
    new = tmp_path / "new" / "fc"
    first = _hold_out(new, HOLD_NEW_OUT)
    monkeypatch.setattr(fc, "load_checkpoint", load_checkpoint)
    try:
        with pytest.raises(RunFolderInUseError) as refused:
            main([*argv, "--out", str(new)])
        assert f"{new} is in use by another run (pid {first.pid} on " in str(refused.value)
        assert [p.name for p in new.iterdir()] == [RUN_LOCK]  # the first run's: no record
    finally:
        first.stdin.close()  # the first run fails: what it made goes
        assert first.wait() == 0
    assert not (tmp_path / "new").exists()
    # a command that fails into a new --out leaves no folder (here its model load, at a full
    # disk: nothing of it is kept), nor does one that writes nothing there

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/hf-cache/blob")

    monkeypatch.setattr(fc, "load_checkpoint", full_disk)
    capsys.readouterr()
    assert cli([*argv, "--out", str(new)]) == 2
    err = capsys.readouterr().err
    assert "error: cannot write /hf-cache/blob: " in err and "kept" not in err, err
    assert not (tmp_path / "new").exists()
    from fot.eval.common import lock_out, release_out_locks

    lock_out(new)
    assert [p.name for p in new.iterdir()] == [RUN_LOCK]
    release_out_locks()
    assert not (tmp_path / "new").exists()


def test_a_failed_run_takes_its_records_out_of_a_new_out_but_keeps_any_result(tmp_path):
    """per-token-loss, longbench, gates and lm-eval write run_config.json and a resume record
    before their first result: a run failing after that (data of another tokenizer, a broken
    task) left a new --out holding them. The records go where the new folder holds nothing
    else; with a result beside them, or in a folder that was there before, all stays."""
    from fot.eval.common import lock_out, release_out_locks
    from fot.training.checkpoint import RUN_LOCK

    def failed_run(out: Path, files: list[str]) -> None:
        lock_out(out)
        for name in files:
            (out / name).write_text("{}\n")
        release_out_locks(failed=True)

    records = ["run_config.json", "per_token_loss.resume.json"]
    new = tmp_path / "a" / "new"
    failed_run(new, records)
    assert not (tmp_path / "a").exists()
    failed_run(new, [*records, "per_token_loss_state.npz"])
    assert sorted(p.name for p in new.iterdir()) == sorted([*records, "per_token_loss_state.npz"])
    before = tmp_path / "before"
    before.mkdir()
    failed_run(before, records)
    assert sorted(p.name for p in before.iterdir()) == sorted(records)
    ok = tmp_path / "ok"
    lock_out(ok)
    (ok / "run_config.json").write_text("{}\n")
    release_out_locks()  # a run that ended well keeps its record
    assert sorted(p.name for p in ok.iterdir()) == [RUN_LOCK, "run_config.json"]


def test_a_torchrun_run_into_an_out_in_use_stops_every_process_at_once(ckpts, tmp_path) -> None:
    """Under torchrun rank 0 locks --out: where another run holds it, rank 0 is refused and
    every other rank stops with its error, rather than waiting for rank 0 at the barrier."""
    out = tmp_path / "two"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "fot.eval", "per-token-loss", str(ckpts["llama"]), "--length", "40",
           "--max-docs", "3", "--device", "cpu", "--timeout-s", "300", "--out", str(out)]  # fmt: skip
    first = _hold_out(out)
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=240, env=_this_checkout_env()
        )
    finally:
        first.kill()
        first.wait()
    assert res.returncode != 0
    in_use = f"{out} is in use by another run (pid {first.pid} on "
    rank0 = [x for x in res.stderr.splitlines() if "(rank 0 of 2): error: " in x]
    rank1 = [x for x in res.stderr.splitlines() if "(rank 1 of 2): error: rank 0 stopped" in x]
    assert len(rank0) == len(rank1) == 1 and in_use in rank0[0] and in_use in rank1[0], res.stderr
    assert [p.name for p in out.iterdir()] == [".run.lock"]


def test_several_processes_into_an_out_in_use_stop_before_the_model_loads(ckpts, tmp_path):
    """With several processes (torchrun, srun, or any launcher that sets RANK, WORLD_SIZE and
    LOCAL_RANK itself) rank 0 locked --out only after every process had loaded the model, so
    a run into an --out in use loaded it first (minutes for a large one). Every process now
    stops before: the checkpoint's weights here are broken, so a load would say that first."""
    from srun_tasks import free_port

    broken = tmp_path / "broken"
    shutil.copytree(ckpts["llama"], broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "fot.eval", "per-token-loss", str(broken), "--length", "40",
           "--max-docs", "3", "--device", "cpu", "--timeout-s", "120", "--out", str(out)]  # fmt: skip
    launcher = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    launches = {
        "launcher": [{**launcher, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(2)],
        "srun": srun_environments(2),
    }
    first = _hold_out(out)
    try:
        for how, envs in launches.items():
            procs = [
                subprocess.Popen(
                    cmd, stderr=subprocess.PIPE, text=True, env={**_this_checkout_env(), **env}
                )
                for env in envs
            ]
            errs = [p.communicate(timeout=300)[1] for p in procs]
            assert [p.returncode for p in procs] == [2, 2], (how, errs)
            in_use = f"{out} is in use by another run (pid {first.pid} on "
            for rank, err in enumerate(errs):
                assert f"(rank {rank} of 2): error: " in err and in_use in err, (how, err)
                assert "cannot be loaded" not in err, (how, err)
            assert [p.name for p in out.iterdir()] == [".run.lock"]
    finally:
        first.kill()
        first.wait()


def test_a_one_process_command_under_several_processes_is_refused(
    ckpts, tmp_path, monkeypatch, capsys
) -> None:
    """Every process of torchrun/srun would run the whole needle grid into the same --out."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "n"
    with pytest.raises(ValueError, match=r"^`needle` runs in one process, but 2 were started"):
        main(["needle", str(ckpts["llama"]), "--mode", "passkey", "--out", str(out)])
    assert not out.exists()
    # each process prints its error, naming itself (as train.py's do)
    monkeypatch.setenv("RANK", "1")
    assert cli(["needle", str(ckpts["llama"]), "--mode", "passkey", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(
        "python -m fot.eval needle (rank 1 of 2): error: `needle` runs in one process, but 2 "
    )


def test_needle_and_passkey_resume(ckpts, tmp_path):
    ck = str(ckpts["llama"])
    out = tmp_path / "n"
    args = [
        "needle",
        ck,
        "--mode",
        "passkey",
        "--lengths",
        "64,128",
        "--depths",
        "0,50,100",
        "--max-new-tokens",
        "3",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--train-length",
        "64",
    ]
    s = main(args)
    assert s["cells"] == 6 and 1.0 <= s["mean_score"] <= 10.0
    assert len(_lines(out / "needle_passkey.jsonl")) == 6
    assert (out / "needle_passkey.png").stat().st_size > 1000
    assert len(_lines(out / "needle_passkey.csv")) == 7
    main(args)  # resumed: nothing recomputed, nothing appended
    assert len(_lines(out / "needle_passkey.jsonl")) == 6
    s = main(
        [
            "needle",
            str(ckpts["fot"]),
            "--mode",
            "easy",
            "--lengths",
            "96",
            "--depths",
            "50",
            "--max-new-tokens",
            "2",
            "--out",
            str(tmp_path / "f"),
            "--device",
            "cpu",
        ]
    )
    assert s["cells"] == 1
    _run_config(tmp_path / "f", "needle")


def test_items_saved_twice_by_two_runs_into_one_out_are_counted_once(ckpts, tmp_path):
    """Two runs started at once with the same --out (a job submitted twice) both save every
    item; the rerun reported `cells: 12` for a grid of 6 and wrote each row twice to the CSV,
    and the forgetting curve averaged `repeats: 4` of the 2 asked for."""
    common = ["--out", str(tmp_path / "o"), "--device", "cpu"]
    needle = ["needle", str(ckpts["llama"]), "--mode", "passkey", "--lengths", "64,128",
              "--depths", "0,50,100", "--max-new-tokens", "2", *common]  # fmt: skip
    curve = ["forgetting-curve", str(ckpts["llama"]), "--lengths", "32,64", "--repeats", "2",
             "--out", str(tmp_path / "f"), "--device", "cpu"]  # fmt: skip
    first = {"needle": main(needle), "curve": main(curve)}
    for log in (tmp_path / "o" / "needle_passkey.jsonl", tmp_path / "f" / "forgetting_curve.jsonl"):
        saved = log.read_text()
        log.write_text(saved + saved)  # what the second run appends
    again = main(needle)
    assert again["cells"] == 6 and again == first["needle"]
    assert len(_lines(tmp_path / "o" / "needle_passkey.csv")) == 7
    curve_again = main(curve)
    assert [r["repeats"] for r in curve_again["per_length"]] == [2, 2]
    assert curve_again == first["curve"]
    assert len(_lines(tmp_path / "f" / "forgetting_curve.csv")) == 3


def test_needle_prompt_template_is_a_setting_of_the_results(ckpts, tmp_path):
    """--prompt-template words the easy/standard prompts (tests/test_eval_needle.py checks the
    prompt): saved results resume only with the same wording; passkey mode refuses it."""
    template = tmp_path / "wording.json"
    template.write_text(json.dumps({"needle": " Fact: {answer}\n", "suffix": "\n{question}"}))
    out = tmp_path / "n"
    args = ["needle", str(ckpts["fot"]), "--mode", "standard", "--lengths", "96", "--depths",
            "50", "--max-new-tokens", "2", "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert main([*args, "--prompt-template", str(template)])["cells"] == 1
    record = json.loads((out / "needle_standard.resume.json").read_text())
    assert record["settings"]["--prompt-template"] == {
        "needle": " Fact: {answer}\n",
        "suffix": "\n{question}",
        "prefix": "",
    }
    with pytest.raises(ResumeMismatchError, match="--prompt-template: saved"):
        main(args)  # fot's wording
    with pytest.raises(ValueError, match=r"^--prompt-template is for the easy and standard modes"):
        main(["needle", str(ckpts["fot"]), "--mode", "passkey", "--prompt-template",
              str(template), "--out", str(tmp_path / "p")])  # fmt: skip
    assert not (tmp_path / "p").exists()


def test_the_sample_corpus_is_json_escaped_for_a_model_trained_on_escaped_text(ckpts, tmp_path):
    """A LongCrawl64 model (its export records JSON escaping) reads the sample corpus escaped
    as its training texts were. Oracle: the plain checkpoint on a token folder of the held-out
    texts escaped by json.dumps and tokenized by tiktoken."""
    from fot.data import sample
    from fot.data.tokens import write_token_documents
    from fot.tokenizer import get_encoding

    escaped_ckpt = tmp_path / "json"
    shutil.copytree(ckpts["fot"], escaped_ckpt)
    config = json.loads((escaped_ckpt / "tokenizer_config.json").read_text())
    config["fot_text_escaping"] = "json"
    (escaped_ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    texts = [t for i, t in enumerate(sample.sample_texts()) if i % sample.HELDOUT_EVERY == 13]
    enc = get_encoding()
    folder = tmp_path / "escaped_tokens"
    write_token_documents(
        folder, [np.asarray(enc.encode_ordinary(json.dumps(t)[1:-1]), np.uint16) for t in texts]
    )
    common = ["--length", "48", "--max-docs", "2", "--device", "cpu", "--prepend-bos", "yes"]
    got = main(["per-token-loss", str(escaped_ckpt), "--out", str(tmp_path / "a"), *common])
    want = main(["per-token-loss", str(ckpts["fot"]), "--data", str(folder),
                 "--out", str(tmp_path / "b"), *common])  # fmt: skip
    plain = main(["per-token-loss", str(ckpts["fot"]), "--out", str(tmp_path / "c"), *common])
    assert got["mean_loss"] == pytest.approx(want["mean_loss"], rel=1e-6)
    assert got["mean_loss"] != pytest.approx(plain["mean_loss"], rel=1e-3)
    # sums saved before the sample was escaped for such a model (their record has no escaping)
    # are not resumed as if they were of the same tokens
    record = tmp_path / "a" / "per_token_loss.resume.json"
    saved = json.loads(record.read_text())
    del saved["settings"]["sample text escaping"]
    record.write_text(json.dumps(saved))
    with pytest.raises(
        ResumeMismatchError,
        match=r"sample text escaping: saved '\(not recorded\)', this run 'json'",
    ):
        main(["per-token-loss", str(escaped_ckpt), "--out", str(tmp_path / "a"), *common])
    # forgetting-curve draws S and I from the same escaped stream: each copy is scored on it
    fc = ["--lengths", "64", "--repeats", "1", "--device", "cpu"]
    got = main(["forgetting-curve", str(escaped_ckpt), "--out", str(tmp_path / "d"), *fc])
    want = main(["forgetting-curve", str(ckpts["fot"]), "--data", str(folder),
                 "--out", str(tmp_path / "e"), *fc])  # fmt: skip
    assert got["per_length"] == want["per_length"]


@pytest.mark.parametrize("which", ["llama", "fot"])
def test_forgetting_curve_cli(ckpts, tmp_path, which):
    out = tmp_path / "fc"
    s = main(
        [
            "forgetting-curve",
            str(ckpts[which]),
            "--lengths",
            "32,64",
            "--repeats",
            "2",
            "--out",
            str(out),
            "--device",
            "cpu",
        ]
    )
    assert [r["length"] for r in s["per_length"]] == [32, 64]
    for r in s["per_length"]:
        assert 0.0 <= r["copy_min"] <= r["copy_mean"] <= r["copy_max"] <= 1.0
    assert (out / "forgetting_curve.png").stat().st_size > 1000
    assert len(_lines(out / "forgetting_curve.csv")) == 3


@pytest.mark.parametrize(
    ("argv", "where"),
    [(["per-token-loss", "--length", "12q"], "'12q' in --length '12q'"),
     (["needle", "--lengths", "1k,x"], "'x' in --lengths '1k,x'"),
     (["forgetting-curve", "--lengths", "1k,0.3k"], "'0.3k' in --lengths '1k,0.3k'")],
)  # fmt: skip
def test_a_length_that_does_not_parse_names_its_option(ckpts, tmp_path, argv, where):
    """The error named the value but not the option it came from."""
    command, *options = argv
    with pytest.raises(ValueError, match=re.escape(f"cannot parse {where}: expected whole")):
        main([command, str(ckpts["llama"]), *options, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_gates_cli(ckpts, tmp_path, capsys):
    out = tmp_path / "g"
    s = main(
        [
            "gates",
            str(ckpts["fot"]),
            "--text",
            "The quick brown fox jumps over the lazy dog. " * 3,
            "--max-tokens",
            "24",
            "--layers",
            "0,-1",
            "--heads",
            "0,3",
            "--out",
            str(out),
            "--device",
            "cpu",
        ]
    )
    assert s["maps"] == ["layer 0 head 0", "layer 0 head 3", "layer 1 head 0", "layer 1 head 3"]
    data = np.load(out / "gates.npz")
    F = data["F_l1_h3"]
    A = data["attn_l1_h3"]
    # F from the saved gate values: exp(c_i - c_j) below the diagonal, 1 on it, 0 above.
    c = np.cumsum(data["log_fgate"][1, :, 3].astype(np.float64))
    np.testing.assert_allclose(F[5, 2], np.exp(c[5] - c[2]), rtol=1e-5)
    np.testing.assert_allclose(np.diag(F), 1.0, rtol=1e-6)
    assert np.all(np.triu(F, 1) == 0) and np.all(np.triu(A, 1) == 0)
    np.testing.assert_allclose(A.sum(-1), 1.0, rtol=1e-5)
    assert (out / "gates.png").stat().st_size > 1000
    # Bad choices are named before anything is written.
    for argv, error, message in (
        (["--layers", "2"], ValueError, r"^--layers 2 out of range: .* 2 layers"),
        (["--heads", "0,x"], ValueError, "--heads '0,x': expected comma-separated integers"),
        (
            ["--text-file", str(tmp_path / "none.txt")],
            FileNotFoundError,
            "--text-file .* not exist",
        ),
    ):
        bad = tmp_path / "bad"
        with pytest.raises(error, match=message):
            main(["gates", str(ckpts["fot"]), *argv, "--out", str(bad), "--device", "cpu"])
        assert not bad.exists()
    # a Transformer baseline: its attention maps, and a warning that its gates are all 1
    baseline = make_fot_checkpoint(tmp_path / "transformer", fgate_type="none", use_rope=True)
    capsys.readouterr()
    main(["gates", str(baseline), "--text", "hi there", "--out", str(tmp_path / "y")])
    assert (
        f"gates: warning: {baseline} has no forget gate (fgate_type 'none': a Transformer "
        "baseline); its gates all read 1" in capsys.readouterr().err
    )
    assert (tmp_path / "y" / "gates.png").is_file()
    with pytest.raises(ValueError, match="FoTAttention"):
        main(
            [
                "gates",
                str(ckpts["llama"]),
                "--text",
                "hi there",
                "--out",
                str(tmp_path / "x"),
                "--device",
                "cpu",
            ]
        )


PLOT_COMMANDS = {
    "needle": ("plot_heatmap", ["--mode", "easy", "--lengths", "96", "--depths", "50",
                                "--max-new-tokens", "1"]),
    "forgetting-curve": ("plot_curve", ["--lengths", "32", "--repeats", "1"]),
    "gates": ("plot_gates", ["--text", "a b c d", "--max-tokens", "8"]),
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(PLOT_COMMANDS))
def test_label_names_the_checkpoint_in_the_plot_title(ckpts, tmp_path, monkeypatch, command):
    """`--label` (per-token-loss's legend option) titles the other commands' plots too; without
    it the title names the checkpoint folder."""
    import importlib

    function, argv = PLOT_COMMANDS[command]
    module = importlib.import_module(f"fot.eval.{command.replace('-', '_')}")
    titles = []
    monkeypatch.setattr(module, function, lambda *a, title, **kw: titles.append(title))
    for n, label in enumerate([[], ["--label", "FoT (Pro), seed 1"]]):
        main([command, str(ckpts["fot"]), *argv, *label, "--out", str(tmp_path / str(n)),
              "--device", "cpu"])  # fmt: skip
    assert titles[0].startswith("fot") and titles[1].startswith("FoT (Pro), seed 1")
    assert titles[0][3:] == titles[1][len("FoT (Pro), seed 1") :]  # e.g. ": needle (easy)"


def test_gates_out_of_range_choices_name_only_the_bad_option():
    """`--layers 0,5,-1` on a 2-layer model said `--layers [5] / --heads [] out of range`,
    which reads as if the heads were empty (found running the eval README's gates example on
    the tiny demo model)."""
    from fot.eval.gates import chosen_maps

    ranges = "this model has 2 layers (-2..1) and 4 query heads (-4..3)"
    for layers, heads, named in (
        ([0, 5, -1], [0, 3], "--layers 5"),
        ([0], [9, -5], "--heads 9,-5"),
        ([-3], [4], "--layers -3 and --heads 4"),
    ):
        with pytest.raises(ValueError) as info:
            chosen_maps(layers, heads, 2, 4)
        assert str(info.value) == f"{named} out of range: {ranges}"
    assert chosen_maps([0, -1], [-1], 2, 4) == [(0, 3), (1, 3)]


@pytest.mark.parametrize(
    "overrides",
    [
        # a Transformer baseline: attention through SDPA (also the default on CUDA) bypassed the
        # recorded attention function, and gate_data failed with an IndexError
        {"fgate_type": "none", "use_rope": True, "attn_backend": "sdpa"},
        # sliding window: the maps showed attention to keys outside the window
        {"window_size": 4},
    ],
    ids=["transformer-sdpa", "window"],
)
def test_gate_maps_of_transformer_and_windowed_models(overrides):
    import fot.presets as presets
    from fot.eval.gates import gate_data

    torch.manual_seed(0)
    model = presets.build_model(presets.config("fot_pro", "tiny", **overrides)).eval()
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    data = gate_data(model, ids, [0, -1], [0])
    assert data["log_fgate"].shape[:2] == (model.config.num_hidden_layers, 12)
    for key, A in data["attention"].items():
        A = A.double()
        torch.testing.assert_close(A.sum(-1), torch.ones(12, dtype=torch.float64))
        i, j = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
        window = overrides.get("window_size") or 12
        outside = (j > i) | (i - j >= window)  # keys the layer does not attend to
        assert torch.all(A[outside] == 0) and torch.all(A[~outside] > 0), key
        if overrides.get("fgate_type") == "none":
            assert torch.all(data["F"][key][~(j > i)] == 1)


def test_longbench_with_longbench_prompts_and_the_papers_first_line_scoring(ckpts, tmp_path):
    """--prompts takes templates from a file of LongBench's dataset2prompt.json format and
    --first-line all scores the first line of every task's prediction (the FoX paper's
    eval.py); table2.md says which; a rerun with other scoring is refused, not mixed in."""
    from fot.eval.common import encode_text, load_checkpoint
    from fot.eval.longbench import score_example

    data = tmp_path / "lb"
    data.mkdir()
    example = {"_id": "h0", "input": "Which river?", "context": "The Nile is long.",
               "answers": ["Nile"], "all_classes": None}  # fmt: skip
    (data / "hotpotqa.jsonl").write_text(json.dumps(example) + "\n")
    prompts = tmp_path / "dataset2prompt.json"
    template = "Passages:\n{context}\n\nQuestion: {input}\nAnswer:"
    prompts.write_text(json.dumps({"hotpotqa": template, "trec": "{context}{input}"}))
    out = tmp_path / "out"
    args = ["longbench", str(ckpts["llama"]), "--data-dir", str(data), "--tasks", "hotpotqa",
            "--max-length", "200", "--out", str(out), "--device", "cpu"]  # fmt: skip
    main([*args, "--prompts", str(prompts), "--first-line", "all"])
    (pred,) = [json.loads(x) for x in _lines(out / "pred_hotpotqa.jsonl")]
    _, tokenizer = load_checkpoint(str(ckpts["llama"]), device=torch.device("cpu"))
    filled = "Passages:\nThe Nile is long.\n\nQuestion: Which river?\nAnswer:"
    assert pred["prompt_tokens"] == 1 + len(encode_text(tokenizer, filled))  # BOS + the prompt
    assert pred["score"] == score_example("hotpotqa", pred["prediction"], example, "all")
    table = (out / "table2.md").read_text()
    assert f"prompts from {prompts}" in table and "first line of every prediction" in table
    with pytest.raises(ResumeMismatchError) as err:
        main(args)
    # both are recorded only when given: the defaults are named, not "(not recorded)"
    assert "--first-line: saved 'all', this run 'few-shot' (the default)" in str(err.value)
    assert "--prompts: saved '" in str(err.value)
    assert "this run fot's own wording (the default)" in str(err.value)
    (out / "pred_hotpotqa.jsonl").rename(tmp_path / "pred_hotpotqa.jsonl")
    main(args)  # a run at the defaults, then one with the options
    with pytest.raises(ResumeMismatchError) as err:
        main([*args, "--prompts", str(prompts), "--first-line", "all"])
    assert "--first-line: saved 'few-shot' (the default), this run 'all'" in str(err.value)
    assert "--prompts: saved fot's own wording (the default), this run '" in str(err.value)


def test_longbench_cli(ckpts, tmp_path):
    data = tmp_path / "lb"
    data.mkdir()
    ctx = "Paragraph one talks about rivers. " * 20
    (data / "hotpotqa.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "_id": f"h{i}",
                    "input": "Which topic?",
                    "context": ctx,
                    "answers": ["rivers"],
                    "all_classes": None,
                }
            )
            + "\n"
            for i in range(2)
        )
    )
    (data / "trec.jsonl").write_text(
        json.dumps(
            {
                "_id": "t0",
                "input": "Question: Who wrote Hamlet?\nType:",
                "context": "Question: Where is Rome?\nType: Location",
                "answers": ["Human being"],
                "all_classes": ["Human being", "Location"],
            }
        )
        + "\n"
    )
    out = tmp_path / "out"
    args = [
        "longbench",
        str(ckpts["llama"]),
        "--data-dir",
        str(data),
        "--tasks",
        "hotpotqa,trec",
        "--max-length",
        "64",
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    scores = main(args)
    assert set(scores) == {"hotpotqa", "trec"}
    preds = [json.loads(x) for x in _lines(out / "pred_hotpotqa.jsonl")]
    assert len(preds) == 2 and all(p["prompt_tokens"] == 65 for p in preds)  # BOS + 64
    assert "HotpotQA" in (out / "table2.md").read_text()
    main(args)
    assert len(_lines(out / "pred_hotpotqa.jsonl")) == 2
    with pytest.raises(FileNotFoundError, match=r"narrativeqa\.jsonl"):
        main(
            [
                "longbench",
                str(ckpts["llama"]),
                "--data-dir",
                str(data),
                "--tasks",
                "narrativeqa",
                "--out",
                str(out),
            ]
        )


def test_longbench_resume_ignores_files_of_the_data_dir_its_tasks_do_not_read(ckpts, tmp_path):
    """--data-dir is fingerprinted by the files the tasks read: LongBench-E's files added to
    the folder later (or any other file) do not refuse a resume of the standard tasks, a
    changed task file does."""
    data = tmp_path / "lb"
    data.mkdir()
    row = {"_id": "h0", "input": "Which river?", "context": "The Nile. " * 5, "answers": ["Nile"]}
    (data / "hotpotqa.jsonl").write_text(json.dumps(row) + "\n")
    out = tmp_path / "out"
    args = ["longbench", str(ckpts["llama"]), "--data-dir", str(data), "--tasks", "hotpotqa",
            "--max-length", "32", "--out", str(out), "--device", "cpu"]  # fmt: skip
    first = main(args)
    saved = (out / "pred_hotpotqa.jsonl").read_text()
    (data / "hotpotqa_e.jsonl").write_text(json.dumps({**row, "length": 3}) + "\n")
    (data / "README.txt").write_text("LongBench-E files added\n")
    assert main(args) == first  # resumed
    assert (out / "pred_hotpotqa.jsonl").read_text() == saved  # nothing computed again
    (data / "hotpotqa.jsonl").write_text(json.dumps({**row, "answers": ["Amazon"]}) + "\n")
    with pytest.raises(
        ResumeMismatchError, match=r"--data-dir: hotpotqa\.jsonl in '.*lb' changed since"
    ):
        main(args)
    assert (out / "pred_hotpotqa.jsonl").read_text() == saved


def test_longbench_e_cli_scores_each_length_range(ckpts, tmp_path, monkeypatch):
    """LongBench-E: ``<task>_e`` reads ``<task>_e.jsonl`` and is also scored per length range
    of the rows' ``length``. The model "answers" with the topic its prompt names, so each
    row's score is known: 1 where the reference is that topic, 0 where it is not."""
    import fot.eval.longbench as longbench

    def answer_the_topic(model, ids, *, max_new_tokens, eos_token_id):
        prompt = tokenizer.decode(ids[0].tolist())
        return tokenizer.encode(" " + re.search(r"Topic: (\w+)", prompt).group(1))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpts["llama"])
    monkeypatch.setattr(longbench, "greedy_generate", answer_the_topic)
    data = tmp_path / "lb"
    data.mkdir()
    # (length, reference): the topic is always "rivers"
    rows = [(120, "rivers"), (3999, "lakes"), (4000, "rivers"), (7000, "rivers"),
            (7999, "lakes"), (12000, "lakes")]  # fmt: skip
    (data / "hotpotqa_e.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "_id": f"e{i}",
                    "input": "Which topic?",
                    "context": "Topic: rivers.",
                    "answers": [ref],
                    "all_classes": None,
                    "length": n,
                }
            )
            + "\n"
            for i, (n, ref) in enumerate(rows)
        )
    )
    (data / "hotpotqa.jsonl").write_text(  # the standard file: no length field
        json.dumps(
            {
                "_id": "h0",
                "input": "Which topic?",
                "context": "Topic: rivers.",
                "answers": ["rivers"],
                "all_classes": None,
            }
        )
        + "\n"
    )
    out = tmp_path / "out"
    args = ["longbench", str(ckpts["llama"]), "--data-dir", str(data), "--tasks",
            "hotpotqa,hotpotqa_e", "--out", str(out), "--device", "cpu"]  # fmt: skip
    scores = main(args)
    preds = [json.loads(x) for x in _lines(out / "pred_hotpotqa_e.jsonl")]
    assert [p["score"] for p in preds] == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert scores == {"hotpotqa": 100.0, "hotpotqa_e": 50.0}
    # by hand: [0, 4000): 1, 0 -> 50; [4000, 8000): 1, 1, 0 -> 66.67; 8000 and more: 0
    by_length = json.loads((out / "scores_by_length.json").read_text())
    assert set(by_length) == {"hotpotqa_e"}  # the standard rows carry no length
    assert by_length["hotpotqa_e"] == pytest.approx({"0-4k": 50.0, "4-8k": 200 / 3, "8k+": 0.0})
    table = (out / "by_length.md").read_text()
    assert "| HotpotQA (E) | 50.00 | 66.67 | 0.00 |" in table
    assert "HotpotQA (E)" in (out / "table2.md").read_text()
    # a LongBench-E row without its length is refused before the model runs
    (data / "trec_e.jsonl").write_text(
        json.dumps(
            {"_id": "t", "input": "q", "context": "c", "answers": ["x"], "all_classes": ["x"]}
        )
        + "\n"
    )
    with pytest.raises(ValueError, match=r"trec_e\.jsonl:1 has no valid length"):
        main([*args[:4], "--tasks", "trec_e", "--out", str(tmp_path / "o2"), "--device", "cpu"])
    assert not (tmp_path / "o2").exists()


def test_longbench_rerun_without_lengths_leaves_no_earlier_length_scores(ckpts, tmp_path):
    """A results folder resumed with tasks whose rows carry no length keeps no per length
    scores of an earlier run's tasks: scores.json and table2.md hold this run's tasks only, so
    scores_by_length.json and by_length.md beside them would read as this run's."""
    data = tmp_path / "lb"
    data.mkdir()
    row = {"_id": "h0", "input": "Which river?", "context": "The Nile.", "answers": ["Nile"]}
    (data / "hotpotqa.jsonl").write_text(json.dumps(row) + "\n")  # no length
    (data / "hotpotqa_e.jsonl").write_text(json.dumps({**row, "length": 5}) + "\n")
    out = tmp_path / "out"
    base = ["longbench", str(ckpts["llama"]), "--data-dir", str(data), "--max-length", "64",
            "--out", str(out), "--device", "cpu", "--tasks"]  # fmt: skip
    main([*base, "hotpotqa_e"])
    assert set(json.loads((out / "scores_by_length.json").read_text())) == {"hotpotqa_e"}
    assert set(main([*base, "hotpotqa"])) == {"hotpotqa"}  # the same folder, resumed
    assert set(json.loads((out / "scores.json").read_text())) == {"hotpotqa"}
    assert not (out / "scores_by_length.json").exists()
    assert not (out / "by_length.md").exists()


def test_longbench_retrieval_answer_without_paragraph_refused_before_the_model(ckpts, tmp_path):
    """PassageRetrieval is scored by the paragraph its answer names: an answer that names none
    (here the bare number) is refused with its file and line before the model loads, leaving
    no --out folder, as every other bad row is; it was found only when the first example had
    been generated and scored, after the results folder was claimed."""
    data = tmp_path / "lb"
    data.mkdir()
    row = {"_id": "r0", "input": "A summary.", "context": "Paragraph 1: a.", "length": 9}
    (data / "passage_retrieval_en.jsonl").write_text(
        json.dumps({**row, "answers": ["Paragraph 1"]})
        + "\n"
        + json.dumps({**row, "_id": "r1", "answers": ["1"]})
        + "\n"
    )
    out = tmp_path / "out"
    args = ["longbench", str(ckpts["llama"]), "--data-dir", str(data), "--tasks",
            "passage_retrieval_en", "--max-length", "64", "--out", str(out), "--device", "cpu"]  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"passage_retrieval_en\.jsonl:2 has an answer that names no paragraph \('1'\)",
    ):
        main(args)
    assert not out.exists()


def test_lm_eval_cli_with_local_dataset_root(ckpts, tmp_path):
    """A task whose dataset_path is a hub repo, read offline from --dataset-root."""
    pytest.importorskip("lm_eval")
    repo = tmp_path / "datasets" / "fot-test" / "toyrepo"
    repo.mkdir(parents=True)
    (repo / "test.jsonl").write_text(
        "".join(json.dumps(q) + "\n" for q in [*QUESTIONS, *QUESTIONS])
    )
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub.yaml").write_text(
        "task: fot_toy_hub\ndataset_path: fot-test/toyrepo\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{label}}'\ndoc_to_choice: '{{choices}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    out = tmp_path / "o"
    args = ["lm-eval", str(ckpts["fot"]), "--tasks", "fot_toy_hub", "--include-path",
            str(tmp_path / "tasks"), "--max-length", "64", "--out", str(out), "--device", "cpu"]  # fmt: skip
    # Offline without --dataset-root the hub dataset fails to load; that failed run's empty
    # request cache must not hold the next run (with --dataset-root, another setting) back.
    with pytest.raises(ConnectionError, match="--dataset-root"):
        main(args)
    res = main([*args, "--dataset-root", str(tmp_path / "datasets")])
    assert 0.0 <= res["fot_toy_hub"]["acc,none"] <= 1.0
    assert json.loads((out / "results.json").read_text()) == res
    assert (out / "table1.md").is_file()
    with (out / "results.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert all(set(r) == {"task", "metric", "value"} for r in rows)  # no stray columns
    acc = [r for r in rows if r["task"] == "fot_toy_hub" and r["metric"] == "acc,none"]
    assert len(acc) == 1 and float(acc[0]["value"]) == res["fot_toy_hub"]["acc,none"]
    _run_config(out, "lm-eval")
    # Another checkpoint on this --out: the finished task (and lm-eval's request cache, keyed
    # by request text only) must not be reported as its results.
    saved = (out / "results.jsonl").read_text()
    with pytest.raises(ResumeMismatchError, match="checkpoint: saved results are of") as err:
        main(
            ["lm-eval", str(ckpts["llama"]), "--tasks", "fot_toy_hub", "--include-path",
             str(tmp_path / "tasks"), "--dataset-root", str(tmp_path / "datasets"),
             "--max-length", "64", "--out", str(out), "--device", "cpu"]
        )  # fmt: skip
    assert str(ckpts["fot"].resolve()) in str(err.value) and "--restart" in str(err.value)
    assert (out / "results.jsonl").read_text() == saved


def test_lm_eval_dataset_root_must_hold_every_task_folder(ckpts, tmp_path):
    """--dataset-root and ROOT/<dataset_path> are checked before anything runs."""
    pytest.importorskip("lm_eval")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub.yaml").write_text(
        "task: fot_toy_hub2\ndataset_path: fot-test/toyrepo2\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{label}}'\ndoc_to_choice: '{{choices}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    args = ["lm-eval", str(ckpts["llama"]), "--tasks", "fot_toy_hub2", "--include-path",
            str(tmp_path / "tasks"), "--out", str(tmp_path / "o"), "--device", "cpu"]  # fmt: skip
    missing_root = tmp_path / "no_such_root"
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        main([*args, "--dataset-root", str(missing_root)])
    assert repr(str(missing_root)) in str(err.value) and "--list-datasets" in str(err.value)
    # The fix the message names works before the folder exists.
    listed = main([*args, "--dataset-root", str(missing_root), "--list-datasets"])
    assert listed == {"fot_toy_hub2": "fot-test/toyrepo2"}
    root = tmp_path / "datasets"
    root.mkdir()
    with pytest.raises(FileNotFoundError, match="lacks the dataset folders") as err:
        main([*args, "--dataset-root", str(root)])
    msg = str(err.value)
    assert repr(str(root / "fot-test" / "toyrepo2")) in msg
    # the download command named is one the installed huggingface_hub provides, with options
    # its CLI knows (huggingface_hub 1.0 removed `huggingface-cli`, which the message named)
    command = re.search(r"download it with: (.*)", msg).group(1).split()
    assert command[1] == "download" and "fot-test/toyrepo2" in command, command
    assert command[command.index("--repo-type") + 1] == "dataset", command
    hub_scripts = {
        ep.name: ep.value
        for ep in importlib.metadata.distribution("huggingface_hub").entry_points
        if ep.group == "console_scripts"
    }
    assert command[0] in hub_scripts, (command[0], hub_scripts)
    module, function = hub_scripts[command[0]].split(":")
    run_script = f"import sys; from {module} import {function}; sys.exit({function}())"
    cli_help = subprocess.run(
        [sys.executable, "-c", run_script, "download", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli_help.returncode == 0, cli_help.stderr
    for option in (o for o in command if o.startswith("--")):
        assert option in cli_help.stdout, option
    assert "--list-datasets" in msg
    assert not (tmp_path / "o").exists()  # refused before loading the model or writing


def test_cli_works_without_the_optional_lm_eval_package():
    """lm-eval is an optional extra: without it the other commands still parse and run, and
    `lm-eval` says what to install."""
    code = (
        "import sys; sys.modules['lm_eval'] = None\n"
        "from fot.eval.__main__ import main\n"
        "try:\n"
        "    main(['lm-eval', 'ckpt', '--out', 'x'])\n"
        "except SystemExit as e:\n"
        "    print('EXIT:', e)\n"
        "main(['needle', '--help'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "EXIT: `lm-eval` needs the package 'lm_eval'" in out.stdout, out.stderr[-2000:]
    assert "pip install 'fot[eval]'" in out.stdout
    assert "--mode {easy,standard,passkey}" in out.stdout


def _per_token_loss(ckpt, out, *extra):
    return main(["per-token-loss", str(ckpt), "--length", "48", "--max-docs", "2", "--out",
                 str(out), "--device", "cpu", "--smooth", "5", *extra])  # fmt: skip


def test_a_larger_max_docs_extends_the_saved_sums(ckpts, tmp_path, monkeypatch):
    """A rerun with a larger --max-docs into the same --out was refused as a changed setting,
    so more documents meant redoing the finished ones. It now reads only the new documents;
    the oracle is a fresh run with the larger value. A smaller value is refused (the sums
    cannot be taken apart), and so is any other changed setting."""
    import fot.eval.per_token_loss as ptl
    from fot.data.tokens import write_token_documents

    read: list[int] = []  # documents that went through the model

    def counted(model, inputs, labels):
        read.append(len(inputs))
        return losses(model, inputs, labels)

    losses = ptl.token_losses
    monkeypatch.setattr(ptl, "token_losses", counted)
    monkeypatch.setattr(ptl, "plot_per_token_loss", lambda *a, **k: None)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=k) for k in (60, 50, 20, 70, 48, 90)]  # 20: too short
    write_token_documents(tmp_path / "tok", docs)

    def run(out, *more):
        read.clear()
        summary = main(["per-token-loss", str(ckpts["llama"]), "--data", str(tmp_path / "tok"),
                        "--length", "48", "--device", "cpu", "--out", str(out), *more])  # fmt: skip
        with np.load(out / "per_token_loss.npz") as f:
            return summary, f["loss"], sum(read)

    out = tmp_path / "out"
    assert run(out, "--max-docs", "2")[2] == 2
    grown, loss, new = run(out, "--max-docs", "4")
    fresh, fresh_loss, _ = run(tmp_path / "fresh4", "--max-docs", "4")
    assert new == 2 and grown == fresh and grown["num_documents"] == 4
    np.testing.assert_array_equal(loss, fresh_loss)
    grown, loss, new = run(out)  # no --max-docs: every document (5 long enough)
    fresh, fresh_loss, _ = run(tmp_path / "fresh_all")
    assert new == 1 and grown == fresh and grown["num_documents"] == 5
    np.testing.assert_array_equal(loss, fresh_loss)
    state = (out / "state.npz").read_bytes()
    with pytest.raises(
        ResumeMismatchError,
        match=r"--max-docs: saved no limit, this run 3: a rerun may raise it .* not lower it .*"
        r"or leave --max-docs out to resume them",
    ):
        run(out, "--max-docs", "3")
    with pytest.raises(ResumeMismatchError, match=r":\n  --prepend-bos: saved true, this run fal"):
        run(out, "--prepend-bos", "no")  # the one difference
    assert (out / "state.npz").read_bytes() == state  # untouched


def test_a_smaller_max_docs_names_the_new_out_that_gives_it(ckpts, tmp_path):
    """A rerun with a smaller --max-docs into the same --out was refused with only the ways to
    resume the saved (larger) run: --max-docs as large, or --restart, which moves its sums
    away. The sums cannot be taken apart, so it is still refused, and now names a new --out for
    the smaller value; that run equals a fresh one, and the saved sums stay as they were."""
    out = tmp_path / "out"
    _per_token_loss(ckpts["llama"], out, "--max-docs", "3")
    state = (out / "state.npz").read_bytes()
    with pytest.raises(ResumeMismatchError) as refused:
        _per_token_loss(ckpts["llama"], out, "--max-docs", "1")
    named = re.search(r"for --max-docs 1, run this command with a new --out, e\.g\. --out '([^']+)'"
                      r" \(the saved results stay\), or pass --max-docs 3 or more to resume",
                      str(refused.value))  # fmt: skip
    assert named, str(refused.value)
    new = Path(named[1])
    assert new == tmp_path.resolve() / "out-max-docs-1" and not new.exists()
    assert (out / "state.npz").read_bytes() == state  # untouched
    served = _per_token_loss(ckpts["llama"], new, "--max-docs", "1")
    assert served == _per_token_loss(ckpts["llama"], tmp_path / "fresh", "--max-docs", "1")
    assert served["num_documents"] == 1
    assert _per_token_loss(ckpts["llama"], out, "--max-docs", "3")["num_documents"] == 3


def test_per_token_loss_refuses_saved_sums_of_another_checkpoint(ckpts, tmp_path):
    """Reusing --out with another checkpoint or setting never returns or mixes in old sums."""
    a, b = ckpts["llama"], ckpts["llama2"]
    out = tmp_path / "out"
    first = _per_token_loss(a, out)
    state = (out / "state.npz").read_bytes()
    with pytest.raises(ResumeMismatchError) as err:
        _per_token_loss(b, out)
    msg = str(err.value)
    assert f"saved results are of {str(a.resolve())!r}" in msg and str(b.resolve()) in msg
    assert "another --out" in msg and "--restart" in msg
    with pytest.raises(ResumeMismatchError, match="--max-docs: saved 2, this run 1"):
        main(["per-token-loss", str(a), "--length", "48", "--max-docs", "1", "--out", str(out),
              "--device", "cpu"])  # fmt: skip
    from fot.data.tokens import write_token_documents

    docs = np.random.default_rng(0).integers(0, 50000, size=(2, 60))
    write_token_documents(tmp_path / "tok", list(docs))
    with pytest.raises(ResumeMismatchError, match="--data: saved 'sample', this run '/"):
        _per_token_loss(a, out, "--data", str(tmp_path / "tok"))
    assert (out / "state.npz").read_bytes() == state  # untouched
    # The same checkpoint moved elsewhere resumes (its content is compared, not its path).
    moved = shutil.copytree(a, tmp_path / "moved")
    assert _per_token_loss(moved, out)["mean_loss"] == first["mean_loss"]
    # The same folder re-exported with other weights is another checkpoint.
    shutil.copytree(b, moved, dirs_exist_ok=True)
    with pytest.raises(ResumeMismatchError, match="has changed since"):
        _per_token_loss(moved, out)
    # --restart: the old results are moved aside, this checkpoint's are computed afresh.
    restarted = _per_token_loss(b, out, "--restart")
    fresh = _per_token_loss(b, tmp_path / "fresh")
    assert restarted["mean_loss"] == pytest.approx(fresh["mean_loss"], rel=1e-12)
    assert restarted["mean_loss"] != pytest.approx(first["mean_loss"])
    (old,) = (out / "superseded").iterdir()
    assert (old / "state.npz").read_bytes() == state
    assert json.loads((old / "summary.json").read_text())["mean_loss"] == first["mean_loss"]


_JSONL_COMMANDS = {
    # command: (arguments, result file, a result-changing option with another value)
    "needle": (
        ["--mode", "passkey", "--lengths", "64", "--depths", "0,100", "--max-new-tokens", "2"],
        "needle_passkey.jsonl",
        ["--seed", "1"],
    ),
    "forgetting-curve": (
        ["--lengths", "32", "--repeats", "2"],
        "forgetting_curve.jsonl",
        ["--seed", "1"],
    ),
    "longbench": (
        ["--tasks", "hotpotqa", "--max-length", "48"],
        "pred_hotpotqa.jsonl",
        ["--no-bos"],
    ),
}


@pytest.mark.parametrize("command", list(_JSONL_COMMANDS))
def test_resumable_commands_refuse_results_of_another_checkpoint(ckpts, tmp_path, command):
    args, results, other_setting = _JSONL_COMMANDS[command]
    if command == "longbench":
        (tmp_path / "lb").mkdir()
        (tmp_path / "lb" / "hotpotqa.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "_id": f"h{i}",
                        "input": "Which topic?",
                        "context": "Rivers. " * 30,
                        "answers": ["rivers"],
                    }
                )
                + "\n"
                for i in range(2)
            )
        )
        args = [*args, "--data-dir", str(tmp_path / "lb")]
    out = tmp_path / "out"

    def run(ckpt, *extra):
        return main([command, str(ckpts[ckpt]), *args, "--out", str(out), "--device", "cpu",
                     *extra])  # fmt: skip

    run("llama")
    saved = (out / results).read_text()
    with pytest.raises(ResumeMismatchError, match="checkpoint: saved results are of") as err:
        run("llama2")
    assert str(ckpts["llama"].resolve()) in str(err.value)
    assert str(ckpts["llama2"].resolve()) in str(err.value)
    option = other_setting[0]
    with pytest.raises(ResumeMismatchError, match=f"{option}: saved"):
        run("llama", *other_setting)
    assert (out / results).read_text() == saved  # nothing mixed in
    run("llama")  # same checkpoint and settings: resumed, nothing appended
    assert (out / results).read_text() == saved
    run("llama2", "--restart")
    (old,) = (out / "superseded").iterdir()
    assert (old / results).read_text() == saved
    assert len(_lines(out / results)) == len(saved.splitlines())  # every item computed anew
    run("llama2")  # now resumes the new checkpoint's results
    assert len(_lines(out / results)) == len(saved.splitlines())


def _subcommands():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_help_states_the_default_the_code_uses():
    """Every option that takes a value says what happens without it, literal defaults verbatim."""
    for name, parser in _subcommands().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.required or action.nargs == 0:
                continue  # positionals, --out, flags
            text = formatter._expand_help(action)
            assert "default" in text, f"{name} {action.option_strings[0]}: {text!r}"
            if action.default not in (None, []):
                assert f"{action.default}" in text, f"{name} {action.option_strings[0]}: {text!r}"


def test_per_token_loss_default_length_is_the_one_help_names(ckpts, tmp_path):
    """--length defaults to the config field that --help names (fot's trainer writes
    train_length; max_position_embeddings is FoT's RoPE table size)."""
    action = next(
        a for a in _subcommands()["per-token-loss"]._actions if "--length" in a.option_strings
    )
    config = json.loads((ckpts["fot"] / "config.json").read_text())
    named = re.search(
        r"default:[^)]*?\b(train_length|max_position_embeddings|n_positions|max_seq_len|"
        r"seq_length)\b",
        action.help,
    )
    assert named, action.help
    assert config["train_length"] != config["max_position_embeddings"]  # the trap is present
    s = main(["per-token-loss", str(ckpts["fot"]), "--max-docs", "1", "--out",
              str(tmp_path / "o"), "--device", "cpu"])  # fmt: skip
    assert s["length"] == config[named.group(1)]


def test_out_inside_the_checkpoint_an_empty_out_and_a_file_are_refused(ckpts, tmp_path):
    from fot.eval.common import checkpoint_fingerprint

    ck = ckpts["llama"]
    before = checkpoint_fingerprint(ck)
    (tmp_path / "afile").write_text("x")
    run = tmp_path / "run"  # a training run's folder (train.py's run_info.json): gates wrote
    run.mkdir()  # its results beside the run's, under the run's lock file name
    (run / "run_info.json").write_text("[]\n")
    # a token folder and another model's folders: results went in beside their files (the
    # token folder was then refused by fot.data.prepare, the other model's fingerprint changed)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("It was a bright cold day in April. " * 20)
    assert prepare([str(tmp_path / "texts"), "--out", str(tmp_path / "tokens")]) == 0
    other = ckpts["llama2"]
    other_before = checkpoint_fingerprint(other)
    step = tmp_path / "checkpoints" / "step_00000004"  # a training checkpoint
    step.mkdir(parents=True)
    (step / "trainer.json").write_text("{}")
    for out, message in (
        (str(ck), "is inside the checkpoint folder"),
        (str(ck / "results"), "is inside the checkpoint folder"),
        ("", "--out is empty"),
        (str(tmp_path / "afile"), "is a file, not a folder"),
        (str(run), f"is a training run's folder: .* e.g. '{run / 'eval'}'"),
        (str(tmp_path / "tokens"), f"is a token folder .* e.g. '{tmp_path / 'tokens_eval'}'"),
        (str(other), f"holds a model .* e.g. '{other.parent / (other.name + '_eval')}'"),
        (str(step), "holds a model \\(a training checkpoint or an export\\)"),
    ):
        for command in ("per-token-loss", "gates"):
            with pytest.raises(ValueError, match=message):
                main([command, str(ck), "--out", out, "--device", "cpu"])
    assert not (ck / "results").exists()
    assert [p.name for p in run.iterdir()] == ["run_info.json"]
    assert checkpoint_fingerprint(ck) == before  # nothing written into the checkpoint
    assert checkpoint_fingerprint(other) == other_before
    assert sorted(p.name for p in (tmp_path / "tokens").iterdir()) == sorted(TOKEN_FILES)
    assert [p.name for p in step.iterdir()] == ["trainer.json"]


def test_damaged_checkpoint_files_and_devices_are_named(ckpts, tmp_path):
    def damaged(name, change):
        folder = tmp_path / name
        shutil.copytree(ckpts["llama"], folder)
        change(folder)
        return folder

    def truncate(folder):
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])

    def drop_vocabulary(folder):
        (folder / "vocab.json").unlink()
        (folder / "merges.txt").unlink()

    cases = [
        (damaged("trunc", truncate), r"weights in .* cannot be loaded .* copy or export"),
        (
            damaged("noweights", lambda f: (f / "model.safetensors").unlink()),
            r"holds no weights \(no \*\.safetensors",
        ),
        (
            damaged("badcfg", lambda f: (f / "config.json").write_text('{"model_type": "lla')),
            r"config\.json' is not valid JSON",
        ),
        (damaged("notok", drop_vocabulary), r"has 1 token\(s\) for a model of 50257"),
    ]
    for folder, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            main(["per-token-loss", str(folder), "--length", "16", "--max-docs", "1",
                  "--out", str(tmp_path / "o"), "--device", "cpu"])  # fmt: skip
    with pytest.raises(ValueError, match="--device 'meta': models cannot be evaluated on 'meta'"):
        main(["per-token-loss", str(ckpts["llama"]), "--out", str(tmp_path / "o"),
              "--device", "meta"])  # fmt: skip


def test_a_model_folder_without_a_tokenizer_is_named_with_a_fix_that_works(tmp_path, capsys):
    """model.save_pretrained(dir) writes no tokenizer: fot.eval failed with transformers'
    "You need to have sentencepiece or tiktoken installed" (tiktoken was). Now one line names
    the folder and the command that adds the tokenizer. Oracle: after running that command,
    the result is the one of the same model exported with its tokenizer (export_hf)."""
    import fot.presets as presets
    from fot.export import export_hf

    torch.manual_seed(0)
    model = presets.build_model(presets.config("fot_pro", "tiny"))
    bare, exported = tmp_path / "bare", tmp_path / "exported"
    model.save_pretrained(bare)
    export_hf(model, exported)
    argv = ["per-token-loss", "--length", "16", "--max-docs", "1", "--device", "cpu"]
    capsys.readouterr()
    assert cli([*argv, str(bare), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {str(bare)!r} holds no tokenizer" in err and "sentencepiece" not in err
    fix = re.search(r'`python -c "(.*?)"`', err)
    assert fix and "save_hf_tokenizer" in fix[1], err
    exec(fix[1], {})  # the command the message gives, as written
    got = main([*argv, str(bare), "--out", str(tmp_path / "bare_out")])
    want = main([*argv, str(exported), "--out", str(tmp_path / "exported_out")])
    assert got["mean_loss"] == want["mean_loss"]


@pytest.mark.parametrize("command", [["gates"], ["needle", "--lengths", "256"]])
def test_a_tokenizer_with_ids_the_model_lacks_is_named_not_a_traceback(command, tmp_path):
    """The tiny paper checkpoint (vocabulary 96) converted on the fly reads GPT-2's ids: gates
    and needle ended in an IndexError inside the embedding at the first id it lacks."""
    tiny = Path(__file__).resolve().parent / "paper_checkpoints" / "fox_pro"
    with pytest.raises(ValueError, match=r"outside its model's vocabulary of 96 ids: the "
                       r"tokenizer is not the model's; put the tokenizer"):  # fmt: skip
        main([command[0], str(tiny), *command[1:], "--out", str(tmp_path / "o"),
              "--device", "cpu"])  # fmt: skip


def test_a_bos_the_model_cannot_embed_is_named_and_the_run_goes_without_it(tmp_path) -> None:
    """per-token-loss of the tiny paper Mamba-2 (vocabulary 96) on ids below 96: the default
    --prepend-bos yes put GPT-2's <|endoftext|> (50256) in front, an IndexError inside the
    embedding; named now, and --prepend-bos no runs (the converted model's own loss)."""
    rows = np.random.default_rng(0).integers(0, 96, size=(2, 40)).astype(np.uint16)
    arr = new_array(str(tmp_path / "small.zarr"), shape=rows.shape, dtype="uint16", chunks=(1, 40))
    arr[:] = rows
    tiny = Path(__file__).resolve().parent / "paper_checkpoints" / "mamba2"
    argv = ["per-token-loss", str(tiny), "--data", str(tmp_path / "small.zarr"), "--length",
            "40", "--device", "cpu"]  # fmt: skip
    with pytest.raises(ValueError, match=r"--prepend-bos yes puts token id 50256 \(the "
                       r"tokenizer's <\|endoftext\|>\) in front of every document, outside "
                       r"this model's vocabulary of 96 ids: pass --prepend-bos no"):  # fmt: skip
        main([*argv, "--out", str(tmp_path / "a")])
    summary = main([*argv, "--prepend-bos", "no", "--out", str(tmp_path / "b")])
    from fot.convert import from_paper

    ids = torch.from_numpy(rows.astype(np.int64))
    with torch.no_grad():
        want = from_paper(tiny).per_token_loss(ids[:, :-1], ids[:, 1:]).mean()
    assert summary["mean_loss"] == pytest.approx(float(want), rel=1e-5)


def test_resume_refuses_other_data_under_the_same_path_and_a_damaged_record(ckpts, tmp_path):

    def write_rows(seed):
        rows = np.random.default_rng(seed).integers(0, 50000, size=(3, 40)).astype(np.uint16)
        shutil.rmtree(tmp_path / "heldout.zarr", ignore_errors=True)
        arr = new_array(str(tmp_path / "heldout.zarr"), shape=rows.shape,
                        dtype="uint16", chunks=(1, 40))  # fmt: skip
        arr[:] = rows

    out = tmp_path / "o"
    argv = ["per-token-loss", str(ckpts["llama"]), "--data", str(tmp_path / "heldout.zarr"),
            "--length", "32", "--max-docs", "2", "--out", str(out), "--device", "cpu"]  # fmt: skip
    write_rows(0)
    first = main(argv)
    assert main(argv)["mean_loss"] == first["mean_loss"]  # same data: resumed
    write_rows(1)  # other tokens, same path, shape and chunking
    with pytest.raises(ResumeMismatchError, match=r"--data: the content of .* has changed since"):
        main(argv)
    write_rows(0)
    assert main(argv)["mean_loss"] == first["mean_loss"]
    (out / "per_token_loss.resume.json").write_text('{"command": "per_tok')
    with pytest.raises(ResumeMismatchError, match=r"per_token_loss\.resume\.json, is damaged"):
        main(argv)


def test_lm_eval_include_path_must_be_a_folder(ckpts, tmp_path):
    pytest.importorskip("lm_eval")
    missing = tmp_path / "no_such_tasks"
    with pytest.raises(FileNotFoundError, match=r"--include-path .*no_such_tasks' is not a folder"):
        main(["lm-eval", str(ckpts["llama"]), "--tasks", "hellaswag", "--include-path",
              str(missing), "--out", str(tmp_path / "o"), "--device", "cpu"])  # fmt: skip
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("name", "change", "named"),
    [
        ("merges.txt", "delete", "cannot be loaded: vocab.json is there but merges.txt is missing"),
        ("vocab.json", "delete", "cannot be loaded: merges.txt is there but vocab.json is missing"),
        ("vocab.json", "truncate", "cannot be loaded: vocab.json cannot be read (not valid JSON"),
        ("merges.txt", "truncate", "cannot be loaded: merges.txt cannot be read (line "),
        ("tokenizer_config.json", "truncate", "cannot be loaded: tokenizer_config.json cannot be "),
        (
            "tokenizer.json",
            "truncate",
            "cannot be loaded: tokenizer.json cannot be read (not valid",
        ),
        ("merges.txt", "cut at a line end", "cannot be used: merges.txt has 199 merges, and "),
    ],
)
def test_a_missing_or_damaged_tokenizer_file_is_one_line_and_its_fix_works(
    tmp_path, capsys, name, change, named
):
    """One GPT-2 vocabulary file left out of a copy gave transformers' "`vocab` and `merges`
    must be both be from memory or both filenames", a cut-short one a traceback from the
    tokenizers library (status 1), then a line that named no file; a merges.txt cut at a line
    end loaded without a word and tokenized texts into other tokens than the model's. Now one
    line names the folder, the file, what is wrong and the fix. Oracle: after the fix it gives
    (copying the file from the export again) the result is the intact checkpoint's."""
    ck = make_llama_checkpoint(tmp_path / "export")
    if name == "tokenizer.json":  # a fast tokenizer's file, as save_pretrained writes it
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(ck).save_pretrained(ck)
    copy = tmp_path / "copy"
    shutil.copytree(ck, copy)
    data = (ck / name).read_bytes()
    if change == "delete":
        (copy / name).unlink()
    elif change == "truncate":
        (copy / name).write_bytes(data[: min(3000, len(data) // 2)])  # cut short
    else:  # the version line and 199 merges: it still reads
        (copy / name).write_bytes(b"".join(data.splitlines(keepends=True)[:200]))
    argv = ["per-token-loss", "--length", "16", "--max-docs", "1", "--device", "cpu"]
    capsys.readouterr()
    assert cli([*argv, str(copy), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m fot.eval per-token-loss: error: "), err
    assert f"the tokenizer in {str(copy)!r} {named}" in err, err
    assert f"copy {name} from the export" in err and "raised by" not in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2, err
    shutil.copy(ck / name, copy / name)  # the fix the message gives
    got = main([*argv, str(copy), "--out", str(tmp_path / "copy_out")])
    want = main([*argv, str(ck), "--out", str(tmp_path / "export_out")])
    assert got["mean_loss"] == want["mean_loss"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_full_disk_mid_run_is_one_line_and_the_rerun_resumes_to_the_same_results(
    tmp_path, capsys, monkeypatch, code
):
    """A full disk (or used-up quota) while a command saved an item ended in a traceback from
    inside pathlib (status 1). Now one line names the file, the cause, what is kept and that
    rerunning resumes (status 2). Oracle: the rerun's results are those of a run the disk never
    stopped."""
    ck = make_llama_checkpoint(tmp_path / "llama")
    argv = ["needle", str(ck), "--lengths", "256", "--depths", "0,50,100", "--device", "cpu"]
    out = tmp_path / "out"
    results = out / "needle_easy.jsonl"
    real_open = Path.open
    appends = []

    def open_(self, mode="r", *args, **kwargs):  # the 2nd item finds the disk full
        if self == results and "a" in mode:
            appends.append(mode)
            if len(appends) == 2:
                raise OSError(code, os.strerror(code), str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    err = _error_after_progress(capsys, [*argv, "--out", str(out)])
    assert err.startswith(
        f"python -m fot.eval needle: error: cannot write {results}: {os.strerror(code)} ("
    ), err
    assert f"kept in {str(out)!r}: rerun the same command to resume" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2, err
    assert len(_lines(results)) == 1  # the first item is saved
    monkeypatch.undo()
    main([*argv, "--out", str(out)])
    main([*argv, "--out", str(tmp_path / "whole")])
    got = sorted(_lines(results))
    assert len(got) == 3 and got == sorted(_lines(tmp_path / "whole" / "needle_easy.jsonl"))


def test_an_out_folder_on_a_read_only_file_system_is_one_line(tmp_path, capsys, monkeypatch):
    """--out on a read-only file system (as root, chmod does not stop a write: the file
    system's error is given by hand) ended in a traceback (OSError EROFS from pathlib)."""
    ck = make_llama_checkpoint(tmp_path / "llama")
    out = tmp_path / "ro" / "out"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == out:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    for command in (
        ["needle", "--lengths", "256", "--depths", "0"],
        ["per-token-loss", "--length", "16", "--max-docs", "1"],
    ):
        capsys.readouterr()
        assert cli([command[0], str(ck), *command[1:], "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"python -m fot.eval {command[0]}: error: cannot write {out}: Read-only file "
            "system (the file system is read-only: write elsewhere)\n"
        ), err
        assert "kept in" not in err and not out.exists()


def test_a_gates_rerun_stopped_while_drawing_leaves_only_its_own_whole_files(tmp_path, monkeypatch):
    """gates rewrites its --out in place: a rerun (another text) stopped by Ctrl-C while it drew
    gate_values.png left that image cut short beside the new gates.npz and the previous run's
    summary.json, which named the other text's token count and gates. Now the previous files go
    first and each is written through a temporary file. Oracle: the token ids of each text, as
    the tokenizer encodes it."""
    from matplotlib.figure import Figure
    from matplotlib.image import imread
    from transformers import AutoTokenizer

    from fot.eval.common import encode_text, eot_id

    ck = make_fot_checkpoint(tmp_path / "fot")
    out = tmp_path / "gates"
    first = "The forget gate decides how much of the past each head keeps. " * 4
    second = "A short second text."
    argv = ["gates", str(ck), "--out", str(out), "--device", "cpu", "--text"]
    assert main([*argv, first])["tokens"] > 40
    tokenizer = AutoTokenizer.from_pretrained(str(ck))
    want = [eot_id(tokenizer), *encode_text(tokenizer, second)]
    real_savefig = Figure.savefig

    def savefig(self, fname, *args, **kwargs):  # Ctrl-C halfway through gate_values.png
        if "gate_values" in str(fname):
            Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
            raise KeyboardInterrupt
        return real_savefig(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    with pytest.raises(KeyboardInterrupt):
        main([*argv, second])
    names = sorted(f.name for f in out.iterdir() if f.name != ".run.lock")  # the --out lock
    assert names == ["gates.npz", "gates.png", "run_config.history.jsonl", "run_config.json",
                     "summary.json"]  # fmt: skip
    assert json.loads((out / "summary.json").read_text())["tokens"] == len(want)
    assert np.load(out / "gates.npz")["tokens"].tolist() == want  # the second run's
    assert imread(out / "gates.png").ndim == 3  # a whole image
    monkeypatch.undo()
    assert main([*argv, second])["tokens"] == len(want)  # rerun: every file, of the second text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == len(want) and (out / "gate_values.png").stat().st_size > 1000


def test_a_per_token_loss_run_stopped_while_writing_its_results_leaves_no_cut_short_file(
    ckpts, tmp_path, monkeypatch
):
    """A run stopped (Ctrl-C) while np.savez wrote per_token_loss.npz left that file cut short
    in --out, where it reads as a result. Now it is written through a temporary file and a
    rename. Oracle: the rerun's results are those of a run never stopped."""
    argv = ["per-token-loss", str(ckpts["llama"]), "--length", "16", "--max-docs", "2",
            "--device", "cpu"]  # fmt: skip
    out = tmp_path / "ptl"
    real_savez = np.savez

    def savez(file, *args, **kwargs):  # Ctrl-C halfway through per_token_loss.npz
        if "per_token_loss" in Path(file).name:
            Path(file).write_bytes(b"PK\x03\x04" + b"\0" * 100)
            raise KeyboardInterrupt
        return real_savez(file, *args, **kwargs)

    monkeypatch.setattr(np, "savez", savez)
    with pytest.raises(KeyboardInterrupt):
        main([*argv, "--out", str(out)])
    assert not [f.name for f in out.iterdir() if "per_token_loss.npz" in f.name]  # nor a temp
    monkeypatch.undo()
    got = main([*argv, "--out", str(out)])  # resumes from state.npz
    want = main([*argv, "--out", str(tmp_path / "whole")])
    assert got["mean_loss"] == pytest.approx(want["mean_loss"])
    np.testing.assert_allclose(
        np.load(out / "per_token_loss.npz")["loss"],
        np.load(tmp_path / "whole" / "per_token_loss.npz")["loss"],
    )


def test_a_full_disk_at_a_result_file_still_says_that_a_rerun_resumes(
    ckpts, tmp_path, monkeypatch, capsys
):
    """A result file is written whole (written_whole), whose own one-line WriteError used to
    reach the user without the advice every other failed write of a resuming command gives:
    the finished items are kept and rerunning the same command resumes from them. Oracle: the
    rerun's results are those of a run whose disk never filled."""
    argv = ["per-token-loss", str(ckpts["llama"]), "--length", "16", "--max-docs", "2",
            "--device", "cpu"]  # fmt: skip
    out = tmp_path / "ptl"
    real_write_text = Path.write_text

    def write_text(self, *args, **kwargs):  # the disk fills at summary.json
        if self.name.startswith(".summary.json."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    err = _error_after_progress(capsys, [*argv, "--out", str(out)])
    assert err.startswith(
        f"python -m fot.eval per-token-loss: error: cannot write {out / 'summary.json'}: "
        f"{os.strerror(errno.ENOSPC)} ("
    ), err
    assert err.splitlines()[0].endswith(
        f". Items finished before it are kept in {str(out)!r}: rerun the same command to resume"
    ), err
    assert "Traceback" not in err and not (out / "summary.json").exists()
    monkeypatch.undo()
    got = main([*argv, "--out", str(out)])
    want = main([*argv, "--out", str(tmp_path / "whole")])
    assert got["mean_loss"] == pytest.approx(want["mean_loss"])
    assert json.loads((out / "summary.json").read_text()) == got


def test_a_forgetting_curve_rerun_stopped_while_drawing_keeps_the_previous_whole_plot(
    ckpts, tmp_path, monkeypatch
):
    """A rerun stopped (Ctrl-C) while it drew forgetting_curve.png left the previous run's
    plot cut short. Now each result file is written through a temporary file and a rename.
    Oracle: the previous run's bytes."""
    from matplotlib.figure import Figure

    argv = ["forgetting-curve", str(ckpts["llama"]), "--lengths", "32", "--repeats", "1",
            "--out", str(tmp_path / "fc"), "--device", "cpu"]  # fmt: skip
    main(argv)
    before = {f.name: f.read_bytes() for f in (tmp_path / "fc").iterdir()}

    def savefig(self, fname, *args, **kwargs):  # Ctrl-C halfway through the plot
        Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", savefig)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    after = {f.name: f.read_bytes() for f in (tmp_path / "fc").iterdir()}
    assert sorted(after) == sorted([*before, "run_config.history.jsonl"])  # no temporary file
    assert after["forgetting_curve.png"] == before["forgetting_curve.png"]


@pytest.mark.parametrize("case", ["under a file", "read-only folder"])
def test_an_out_under_a_file_or_in_a_read_only_folder_is_refused_before_the_model_loads(
    ckpts, tmp_path, capsys, monkeypatch, case
):
    """--out afile/sub ended in a bare NotADirectoryError traceback, and an --out in a
    read-only folder was refused only when the results were first written; both after the
    model had loaded. Now each is one line that names the path and the fix, before it loads."""
    import fot.eval.per_token_loss as per_token_loss

    def load_checkpoint(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(per_token_loss, "load_checkpoint", load_checkpoint)
    if case == "under a file":
        blocker = tmp_path / "afile"
        blocker.write_text("x")
        out = blocker / "sub" / "deeper"
        want = f"is under {str(blocker)!r}, which is a file, not a folder; name an --out outside it"
    else:
        blocker = tmp_path / "ro"
        blocker.mkdir()
        out = blocker / "sub"
        want = f"{str(blocker)!r} cannot be written (no write permission or a read-only file"
        if os.geteuid() == 0:  # root writes through chmod: the kernel's answer for others
            real_access = os.access

            def access(path, mode, *args, **kwargs):
                if Path(path) == blocker and mode & os.W_OK:
                    return False
                return real_access(path, mode, *args, **kwargs)

            monkeypatch.setattr(os, "access", access)
        else:
            blocker.chmod(0o555)
    try:
        status = cli(["per-token-loss", str(ckpts["llama"]), "--out", str(out), "--device", "cpu"])
    finally:
        blocker.chmod(0o755)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith(f"python -m fot.eval per-token-loss: error: --out {str(out)!r}"), err
    assert want in err and "Traceback" not in err, err
    assert not out.exists()


def test_max_docs_beyond_the_long_enough_documents_says_how_many_are_used(ckpts, tmp_path, capsys):
    """--max-docs 5 over data with 2 documents of at least --length tokens evaluated 2 without
    a word. Now a line says so, and summary.json counts them. Oracle: the documents' lengths."""
    from fot.data.tokens import write_token_documents

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=n) for n in (40, 10, 30)]
    write_token_documents(tmp_path / "tok", docs)
    long_enough = sum(len(d) >= 20 for d in docs)
    argv = ["per-token-loss", str(ckpts["llama"]), "--data", str(tmp_path / "tok"), "--length",
            "20", "--device", "cpu", "--max-docs"]  # fmt: skip
    capsys.readouterr()
    s = main([*argv, "5", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    line = (
        f"per-token-loss: evaluating {long_enough} of the 5 documents that --max-docs asks for: "
        f"only {long_enough} documents in {str(tmp_path / 'tok')!r} have at least 20 tokens"
    )
    assert line in err, err
    assert s["num_documents"] == long_enough
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["num_documents"] == long_enough
    main([*argv, "2", "--out", str(tmp_path / "o2")])
    assert "--max-docs asks for" not in capsys.readouterr().err  # as many as asked: no line


MISSING_MATPLOTLIB = {
    **{command: (argv, PLOT_COMMANDS[command][1]) for argv, command in [
        (["summary_easy.json", "needle_easy.csv"], "needle"),
        (["summary.json", "forgetting_curve.csv"], "forgetting-curve"),
        (["summary.json", "gates.npz"], "gates"),
    ]},
    "per-token-loss": (["summary.json", "per_token_loss.npz"], ["--length", "64", "--max-docs", "1"]),
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(MISSING_MATPLOTLIB))
def test_without_matplotlib_the_plot_step_is_one_line_after_the_results_are_saved(
    ckpts, tmp_path, monkeypatch, capsys, command
):
    """Without matplotlib, every command ended in a ModuleNotFoundError traceback (status 1)
    at its plot, after its results were saved (gates: before its summary.json); it is now one
    line naming the image, `pip install matplotlib` and the --out that holds the results, all
    saved, and a rerun with matplotlib draws the plot. Oracle: the results files themselves."""
    saved, argv = MISSING_MATPLOTLIB[command]
    out = tmp_path / "o"
    argv = [command, str(ckpts["fot"]), *argv, "--out", str(out), "--device", "cpu"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as `import matplotlib` fails
    assert cli(argv) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if ": error: " in x)
    assert "pip install matplotlib" in line and repr(str(out)) in line, line
    assert "Traceback" not in err and err.count(": error: ") == 1
    assert all((out / name).stat().st_size > 0 for name in saved)
    assert not list(out.glob("*.png"))
    monkeypatch.undo()
    assert cli(argv) == 0  # resumed (gates: run again), now with its plot
    assert list(out.glob("*.png"))


def test_an_lm_eval_limit_run_says_so_with_the_examples_scored_per_task(ckpts, tmp_path):
    """`lm-eval --limit` scored a subset (or, past a task's size, all of it) and table1.md and
    the printed table looked like a full run's; they now end with a line naming --limit and
    how many examples each task scored of how many it has. Oracle: the task files' lengths."""
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, n in (("fot_four", 4), ("fot_two", 2)):
        (tasks / f"{name}.jsonl").write_text(
            "".join(json.dumps(QUESTIONS[i % 2]) + "\n" for i in range(n))
        )
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {tasks / name}.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
            "doc_to_text: '{{question}}'\ndoc_to_target: '{{label}}'\n"
            "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n"
        )
    out = tmp_path / "o"
    argv = ["lm-eval", str(ckpts["llama"]), "--tasks", "fot_four,fot_two", "--include-path",
            str(tasks), "--max-length", "64", "--out", str(out), "--device", "cpu"]  # fmt: skip
    main([*argv, "--limit", "3"])
    last = (out / "table1.md").read_text().strip().splitlines()[-1]
    assert last.startswith("--limit 3: a smoke run") and last.endswith(
        "examples scored per task: fot_four 3 of 4, fot_two 2 of 2"
    ), last
    main([*argv, "--restart"])  # the whole tasks: no such line
    assert "--limit" not in (out / "table1.md").read_text()


def test_a_longbench_limit_run_says_so_with_the_examples_scored_per_task(ckpts, tmp_path):
    """`longbench --limit` scored the first examples of each task (all of a shorter file) and
    table2.md, by_length.md (LongBench-E's ranges) and the printed table looked like a full
    run's; they now end with a line naming --limit and how many examples each task scored of
    how many its file holds. Oracle: the rows written and the predictions saved."""
    data = tmp_path / "lb"
    data.mkdir()
    row = {"input": "Which topic?", "context": "Rivers run. " * 10, "answers": ["rivers"]}
    row["length"] = 30  # words: LongBench-E's field, which by_length.md groups by
    for task, n in (("hotpotqa", 3), ("qasper", 1)):
        (data / f"{task}.jsonl").write_text(
            "".join(json.dumps({**row, "_id": f"{task}{i}"}) + "\n\n" for i in range(n))
        )
    out = tmp_path / "o"
    argv = ["longbench", str(ckpts["llama"]), "--data-dir", str(data), "--tasks",
            "hotpotqa,qasper", "--max-length", "32", "--out", str(out), "--device", "cpu"]  # fmt: skip
    main([*argv, "--limit", "2"])
    assert [len(_lines(out / f"pred_{t}.jsonl")) for t in ("hotpotqa", "qasper")] == [2, 1]
    last = (out / "table2.md").read_text().strip().splitlines()[-1]
    assert last.startswith("--limit 2: a smoke run") and last.endswith(
        "examples scored per task: hotpotqa 2 of 3, qasper 1 of 1"
    ), last
    assert (out / "by_length.md").read_text().strip().splitlines()[-1] == last
    main(argv)  # the whole files (resumed, extended): no such line
    assert "--limit" not in (out / "table2.md").read_text()
    assert "--limit" not in (out / "by_length.md").read_text()


def test_a_refused_run_into_a_new_out_leaves_nothing_where_there_is_no_flock(tmp_path) -> None:
    """On a file system without flock (some network mounts) lock_out made a new --out and
    an empty .run.lock in it that locked nothing: a command that then failed left the folder
    and the file behind, where a refused run leaves --out as it was. No lock file is made
    there now, so the folders lock_out made go again."""
    import fcntl
    from unittest import mock

    from fot.eval.common import lock_out, release_out_locks

    def no_flock(*args: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    out = tmp_path / "new" / "out"
    with mock.patch.object(fcntl, "flock", no_flock):
        lock_out(out)
        assert out.is_dir()  # made before the model would load
        release_out_locks(failed=True)
    assert list(tmp_path.iterdir()) == []
