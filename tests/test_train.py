"""The trainer end to end on CPU: learning, exact resume (also after SIGKILL), atomic
checkpoints, DDP over gloo equal to one process, multirun folders, NaN stop."""

from __future__ import annotations

import errno
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from killed_runs import host_name
from omegaconf import OmegaConf
from srun_tasks import free_port, srun_environments
from zarr_arrays import new_array

from fot.training import TrainingDivergedError, TrainingStopped, register_configs, train
from fot.training.checkpoint import FAULT_ENV, list_checkpoints
from fot.training.config import ScheduleConfig, WandbConfig
from fot.training.optim import lr_at, param_groups
from fot.training.parallel import check_fsdp_backend

ROOT = Path(__file__).resolve().parents[1]
register_configs()

# A very small model and batch: 4 sequences of 64 tokens per step in 2 micro batches.
SMALL = [
    "++model.overrides={hidden_size:32,num_hidden_layers:1,num_heads:2}",
    "data.seq_len=64",
    "data.val_tokens=128",
    "global_batch_tokens=256",
    "micro_batch_size=2",
    "total_tokens=2048",
    "log_every_tokens=256",
    "val_every_tokens=0",
    "ckpt_every_tokens=512",
    "keep_last=2",
    "schedule.warmup_tokens=512",
    "optim.lr=0.01",
    "export_hf=false",
    "progress=false",
    "wandb.mode=disabled",
    "device=cpu",
]


def _cfg(out_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[*SMALL, f"out_dir={out_dir}", *overrides])


def _losses(out_dir: Path) -> dict[int, float]:
    """Training loss per step; a step logged twice (re-run after a resume) keeps the last."""
    out: dict[int, float] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def _metrics_lines(result: dict) -> list[str]:
    return (Path(result["checkpoint"]).parents[1] / "metrics.jsonl").read_text().splitlines()


def _file_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes: to check what a refused run left alone."""
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _sweep_args(sweep: Path, *overrides: str) -> list[str]:
    """The command line of a ``train.py -m`` sweep of the SMALL settings and ``overrides``
    into ``hydra.sweep.dir=sweep``."""
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        *SMALL,
        *overrides,
        f"hydra.sweep.dir={sweep}",
    ]


def _refused_sweep_rerun(
    args: list[str], sweep: Path, cwd: Path
) -> tuple[list[str], dict[str, bytes], dict[str, bytes]]:
    """Run ``args``, a rerun of the sweep in ``sweep`` that must be refused (exit status 2),
    and check that it changed no file there but Hydra's multirun.yaml (the rerun's) and job
    0's train.log (each rerun appends to it). Returns its error lines and the sweep folder's
    files before and after it."""
    before = _file_bytes(sweep)
    res = _run_script(args, cwd=cwd)
    assert res.returncode == 2, res.stderr[-3000:]
    after = _file_bytes(sweep)
    changed = {p for p in before if before[p] != after.get(p)}
    assert changed <= {str(sweep / "multirun.yaml"), str(sweep / "0" / "train.log")}, changed
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    return errors, before, after


def _run_script(args: list[str], *, env_extra: dict[str, str] | None = None, cwd: Path):
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _small_run_with_fault(out: Path, fault: str, *extra: str) -> subprocess.CompletedProcess:
    """``train.py`` of the SMALL settings (and ``extra``) into ``out`` with the injected
    ``fault`` (:data:`FAULT_ENV`), run in ``out``'s parent folder."""
    args = [
        sys.executable,
        str(ROOT / "train.py"),
        *SMALL,
        f"out_dir={out}",
        f"hydra.run.dir={out}",
    ]
    return _run_script([*args, *extra], env_extra={FAULT_ENV: fault}, cwd=out.parent)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> dict[int, float]:
    """An uninterrupted 8-step run; its per-step losses are the oracle for resumed runs."""
    out = tmp_path_factory.mktemp("reference")
    train(_cfg(out))
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 9))
    return losses


def test_short_run_learns_and_writes_everything(tmp_path, monkeypatch, caplog, capsys) -> None:
    # no API key and no WANDB_MODE: wandb must fall back to offline, not crash
    caplog.set_level(logging.INFO, logger="fot.train")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    # fot run from a copy of the tree (no git checkout): train.log says so, not "git None"
    monkeypatch.setattr("fot.training.trainer.git_sha", lambda: None)
    out = tmp_path / "run"
    settings = ["total_tokens=4096", "wandb.mode=auto", "export_hf=true", "val_every_tokens=2048"]
    result = train(_cfg(out, *settings, "progress=true"))
    # stderr is no terminal here: the bar is plain lines (no carriage returns, not one per step)
    err = capsys.readouterr().err
    assert "\r" not in err and re.search(r"^train: 100%\|#+\| 16/16 \[.*loss=", err, re.M), err
    assert 2 <= len(re.findall(r"^train: ", err, re.M)) < 16
    losses = _losses(out)
    assert len(losses) == 16
    first, last = losses[1], sum(losses[k] for k in (14, 15, 16)) / 3
    assert last < first - 1.0, losses  # from ~ln(50257) = 10.8 down by more than a nat
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rec = next(r for r in recs if "loss" in r)
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib", "tokens"):
        assert key in train_rec
    vals = [r for r in recs if "val/loss" in r]
    assert [v["step"] for v in vals] == [8, 16]  # mid-run and final validation
    assert "val/loss_last_64" in vals[-1] and math.isfinite(vals[-1]["val/loss"])
    assert vals[-1]["val/loss"] < vals[0]["val/loss"]
    # the mid-run validation is logged (train.log), not only written above the progress bar
    mid = f"step 8: val/loss {vals[0]['val/loss']:.4f}"
    assert any(r.getMessage().startswith(mid) for r in caplog.records), caplog.text
    info = json.loads((out / "run_info.json").read_text())[0]
    assert info["versions"]["torch"] == torch.__version__
    # it logged to wandb: wandb's version shapes what its files hold
    assert info["versions"]["wandb"] == importlib.metadata.version("wandb")
    assert info["git_sha"] is None and info["config"]["model"]["name"] == "fot_pro"
    assert "git none (fot is not a git checkout) | " in caplog.text, caplog.text
    assert list_checkpoints(out / "checkpoints")[-1].name == "step_00000016"
    assert len(list_checkpoints(out / "checkpoints")) == 2  # keep_last
    assert list((out / "wandb").glob("offline-run-*"))  # offline without a key
    hf = Path(result["hf_dir"])
    assert (hf / "config.json").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fot  # noqa: F401 - registers the HF classes

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.train_length == 64  # data.seq_len, read by fot.eval as the default
    assert AutoTokenizer.from_pretrained(hf).encode("Hello world")
    # the sample corpus is plain text: no escaping recorded (LongCrawl64's is JSON)
    assert "fot_text_escaping" not in json.loads((hf / "tokenizer_config.json").read_text())
    x = torch.tensor([[50256, 15496, 995]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=x).logits).all()


def test_resume_after_sigkill_is_bit_identical(tmp_path, reference_run) -> None:
    out = tmp_path / "run"
    proc = _small_run_with_fault(out, "kill_after_step:5")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [
        "step_00000002",
        "step_00000004",
    ]
    assert max(_losses(out)) == 5  # it died after step 5, past the step-4 checkpoint
    train(_cfg(out))  # resume=auto picks step 4
    assert _losses(out) == reference_run  # exact float equality, every step


def test_out_dir_that_is_a_file_is_a_one_line_error_and_the_file_is_kept(tmp_path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    proc = _run_script([sys.executable, str(ROOT / "train.py"), f"out_dir={f}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"train.py: error: out_dir={f} is a file, not a folder; choose a new folder for the run "
        "(or an earlier run's folder, to resume it)"
    )
    assert f.read_text() == "keep me"


def test_out_dir_that_is_an_export_checkpoint_or_token_folder_is_refused(tmp_path) -> None:
    """out_dir=<run>/hf (meant: init_from=) trained a new run inside the export, its
    checkpoints, metrics and a nested hf/ beside the model's files; likewise a training
    checkpoint, a token folder or a folder of fot.eval results. Each is refused before Hydra
    starts, naming the option meant; a run folder, new or earlier, is not."""
    from fot.training.config import out_dir_problem

    export, ckpt, tokens = (
        tmp_path / "hf",
        tmp_path / "run" / "checkpoints" / "step_4",
        tmp_path / "tok",
    )
    for folder, files in ((export, ("config.json", "model.safetensors")),
                          (ckpt, ("trainer.json", "model.pt")), (tokens, ("tokens.bin",))):  # fmt: skip
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_text("{}")
    (tokens / "meta.json").write_text(json.dumps({"format": "fot-tokens", "version": 1}))
    assert out_dir_problem([f"out_dir={export}"]) == (
        f"out_dir={export} is an exported model (config.json and weights), not a run folder: "
        f"to start a run from its weights, pass init_from={export} with a new out_dir"
    )
    assert out_dir_problem([f"hydra.run.dir={ckpt}"]) == (
        f"hydra.run.dir={ckpt} is a training checkpoint, not a run folder: to go on with its "
        f"run, pass that run's folder (out_dir={tmp_path / 'run'}); to start a new run from "
        f"its weights, init_from={ckpt} with a new out_dir"
    )
    assert out_dir_problem([f"out_dir={tokens}"]) == (
        f"out_dir={tokens} is a token folder (data), not a run folder: choose a new folder "
        "for the run"
    )
    results = tmp_path / "eval"  # python -m fot.eval's --out (its run_config.json)
    results.mkdir()
    (results / "run_config.json").write_text("{}")
    assert out_dir_problem([f"out_dir={results}"]) == (
        f"out_dir={results} holds results of python -m fot.eval (run_config.json), not a "
        "training run: choose a new folder for the run"
    )
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "config.json").write_text("{}")  # no weights: not an export
    for fine in (tmp_path / "run", tmp_path / "new", tmp_path / "notes"):
        assert out_dir_problem([f"out_dir={fine}"]) is None, fine
    before = sorted(p.name for p in export.iterdir())
    proc = _run_script([sys.executable, str(ROOT / "train.py"), f"out_dir={export}"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"train.py: error: out_dir={export} is an exported model"
    ), proc.stderr[-3000:]
    assert sorted(p.name for p in export.iterdir()) == before


def test_kill_during_checkpoint_write_resumes_from_previous(tmp_path, reference_run) -> None:
    out = tmp_path / "run"
    proc = _small_run_with_fault(out, "kill_in_checkpoint:4")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (out / "checkpoints" / ".tmp-step_00000004").is_dir()  # half written
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000002"]
    train(_cfg(out))
    assert not (out / "checkpoints" / ".tmp-step_00000004").exists()
    assert _losses(out) == reference_run


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written, as on a full disk."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_a_full_disk_while_a_checkpoint_is_written_is_named_and_resume_is_exact(
    tmp_path, reference_run, monkeypatch
) -> None:
    from fot.errors import WriteError

    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    calls = []
    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # the 7th file is step 6's model.pt
        calls.append(f)
        return real_save(obj, _FullDisk(f, 4096) if len(calls) == 7 else f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(WriteError) as err:
        train(_cfg(out))
    msg = str(err.value)
    # one message naming the file, the cause and the checkpoint to go on from; torch's own
    # error ("unexpected pos ...") named neither
    assert f"cannot write {ckpts / '.tmp-step_00000006' / 'model.pt'}: No space left" in msg
    assert f"the latest is {ckpts / 'step_00000004'}" in msg and "resume=auto" in msg
    # the cut-short checkpoint is gone (its space freed), the earlier ones complete
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004"]
    monkeypatch.setattr(torch, "save", real_save)
    train(_cfg(out))  # resume=auto: from step 4
    assert _losses(out) == reference_run


def test_a_full_disk_while_metrics_are_logged_is_named_and_resume_is_exact(
    tmp_path, reference_run, monkeypatch
) -> None:
    import builtins

    from fot.errors import WriteError

    out = tmp_path / "run"
    real_open = builtins.open
    writes = []

    class HalfWritten:  # the 5th record (step 5's) gets half its bytes in, then ENOSPC
        def __init__(self, f) -> None:
            self._f = f

        def write(self, data):
            writes.append(data)
            if len(writes) == 5:
                self._f.write(data[: len(data) // 2])
                self._f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return HalfWritten(f) if str(file).endswith("metrics.jsonl") and "a" in mode else f

    monkeypatch.setattr(builtins, "open", open_)
    with pytest.raises(WriteError) as err:
        train(_cfg(out))
    msg = str(err.value)
    assert f"cannot write {out / 'metrics.jsonl'}: No space left on device" in msg
    assert "step 5" in msg and "resume=auto" in msg
    # the earlier records are whole, the cut-short one gone
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    monkeypatch.setattr(builtins, "open", real_open)
    train(_cfg(out))  # resume=auto: from step 4
    assert _losses(out) == reference_run
    assert not (out / "metrics.abandoned.jsonl").exists()  # nothing of a cut-short line


def test_a_file_written_atomically_over_the_size_limit_is_named_and_kept(tmp_path) -> None:
    # a real write error: the file size limit (as `ulimit -f`), with SIGXFSZ ignored
    path = tmp_path / "final.json"
    path.write_text("old")
    code = (
        "import resource, signal, sys\n"
        "from fot.training.checkpoint import write_text_atomic\n"
        "from fot.errors import WriteError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "try:\n"
        "    write_text_atomic(sys.argv[1], 'x' * 5000)\n"
        "except WriteError as err:\n"
        "    print(err)\n"
    )
    proc = _run_script([sys.executable, "-c", code, str(path)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"cannot write {path}: File too large"), proc.stdout
    assert f"{path} is as it was" in proc.stdout
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["final.json"]  # no cut-short temp file


def _ended_pid() -> int:
    """The id of a process that has ended (and been waited for: no zombie)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_write_killed_midway_leaves_a_temporary_file_that_the_next_write_removes(
    tmp_path, caplog
) -> None:
    # A SIGKILL (the OOM killer, a power loss) while a file was written whole left its hidden
    # temporary file for good, and each rerun added one. Now the next write of the file removes
    # those of ended processes of this host, and only those: a live process' and another host's
    # (whose process ids mean nothing here, on a shared file system) are kept.
    from fot.training.checkpoint import write_text_atomic

    path = tmp_path / "summary.json"
    path.write_text("old")
    code = (
        "import os, signal, sys\n"
        "from fot.training.checkpoint import written_whole\n"
        "with written_whole(sys.argv[1]) as tmp:\n"
        "    tmp.write_text('half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.Popen([sys.executable, "-c", code, str(path)], env=env, cwd=tmp_path)
    assert killed.wait(timeout=300) == -9
    (left,) = [p for p in tmp_path.iterdir() if p != path]
    host = host_name()
    assert left.name == f".summary.json.{host}.{killed.pid}.tmp.json"  # the host is recorded
    assert left.read_text() == "half"
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        kept = [
            f".summary.json.{host}.{sleeper.pid}.tmp.json",  # a live process' of this host
            f".summary.json.elsewhere.{killed.pid}.tmp.json",  # another host's
            f".other.json.{host}.{killed.pid}.tmp.json",  # another file's
        ]
        for name in kept:
            (tmp_path / name).write_text("half")
        with caplog.at_level(logging.WARNING):
            write_text_atomic(path, "whole")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert path.read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "summary.json"])
    assert [r.getMessage() for r in caplog.records] == [
        f"removed {left.name} from {tmp_path}: left by writes of summary.json that did not "
        f"finish (process {killed.pid} of this host)"
    ]


def test_a_temporary_file_of_an_earlier_version_is_removed_once_a_day_unchanged(
    tmp_path,
) -> None:
    # Names written before the host was recorded (.{name}.{pid}.tmp{suffix}) do not say whose
    # process id they hold: removed when no process here has it and the file has not changed
    # for a day (a write in progress on another host changes it).
    from fot.training.checkpoint import write_text_atomic

    path = tmp_path / "state.npz"
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        old, recent, live = (
            tmp_path / f".state.npz.{pid}.tmp.npz"
            for pid in (_ended_pid(), _ended_pid(), sleeper.pid)
        )
        day_ago = time.time() - 25 * 3600
        for p in (old, recent, live):
            p.write_bytes(b"half")
        for p in (old, live):
            os.utime(p, (day_ago, day_ago))
        write_text_atomic(path, "whole")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [recent.name, live.name, "state.npz"]
    )


@pytest.mark.parametrize("code", [errno.EROFS, errno.EDQUOT], ids=["EROFS", "EDQUOT"])
def test_a_run_folder_on_a_read_only_file_system_is_one_line(tmp_path, monkeypatch, code) -> None:
    # as root, chmod does not stop a write: the file system's error is given by hand
    from fot.errors import WriteError

    out = tmp_path / "ro" / "run"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == out:
            raise OSError(code, os.strerror(code), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(WriteError, match=f"^cannot write {out}: {os.strerror(code)} .*out_dir"):
        train(_cfg(out))
    assert not out.exists()


@pytest.mark.parametrize(
    ("code", "when"),
    [
        (errno.ENOSPC, "once there is room"),
        (errno.EROFS, "once the file system is writable again"),
        (errno.EACCES, "once you may write there"),
        (errno.EPERM, "once you may write there"),
    ],
    ids=["ENOSPC", "EROFS", "EACCES", "EPERM"],
)
def test_a_failed_write_advises_what_fits_its_cause(tmp_path, monkeypatch, code, when) -> None:
    # The advice after a failed checkpoint or metrics write said "once there is room" also for a
    # read-only file system or a folder one may not write, where no room ever comes: for those
    # it names a folder of one's own and the checkpoint to resume from there.
    from fot.errors import WriteError
    from fot.training import checkpoint
    from fot.training.metrics import MetricsLogger

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    state = {"step": 0, "tokens": 0, "data": {}, "sizes": {}}
    root = tmp_path / "run" / "checkpoints"

    def save(step: int) -> Path:
        return checkpoint.save_checkpoint(root, step=step, model=model, optimizer=opt,
                                          trainer_state=state, keep_last=3, is_main=True)  # fmt: skip

    latest = save(2)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(f))

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(WriteError) as err:
        save(4)
    monkeypatch.setattr(torch, "save", real_save)
    msg = str(err.value)
    assert msg.startswith(f"cannot write {root / '.tmp-step_00000004' / 'model.pt'}: ")
    assert f"the latest is {latest}" in msg and when in msg, msg
    folder_cause = code != errno.ENOSPC
    assert ("once there is room" in msg) == (not folder_cause), msg
    # the checkpoint named to go on from elsewhere is the complete one the save left
    assert (f"out_dir=<a folder you can write> resume={latest} " in msg) == folder_cause, msg
    assert checkpoint.list_checkpoints(root) == [latest]

    cfg = OmegaConf.structured(WandbConfig(mode="disabled"))
    logger = MetricsLogger(tmp_path / "run", enabled=True, wandb_cfg=cfg, config={})

    class Failing:
        def __init__(self, f) -> None:
            self._f = f

        def write(self, data) -> int:
            raise OSError(code, os.strerror(code))

        def __getattr__(self, name):
            return getattr(self._f, name)

    logger._file = Failing(logger._file)
    with pytest.raises(WriteError) as err:
        logger.log({"step": 5, "tokens": 8})
    logger._file = logger._file._f
    logger.close()
    msg = str(err.value)
    assert msg.startswith(f"cannot write {tmp_path / 'run' / 'metrics.jsonl'}: ")
    assert "step 5" in msg and when in msg, msg
    assert ("once there is room" in msg) == (not folder_cause), msg
    assert ("out_dir=<a folder you can write> resume=<its latest" in msg) == folder_cause, msg


def test_activation_checkpointing_gives_the_same_losses(tmp_path, reference_run) -> None:
    # two steps inside the warmup: the LR does not depend on total_tokens yet
    out = tmp_path / "run"
    train(
        _cfg(out, "total_tokens=512", "parallel.activation_checkpointing=true", "data.val_tokens=0")
    )
    assert _losses(out) == {1: reference_run[1], 2: reference_run[2]}


def test_a_compiled_run_resumes_exactly_and_its_checkpoints_load_without_compile(
    tmp_path,
) -> None:
    """parallel.compile=true compiles each block in place (``Module.compile``), so the weights
    keep their names (no ``_orig_mod.``): a compiled run stopped by SIGTERM resumes compiled to
    the same losses as an uninterrupted compiled run, and its checkpoint resumes without
    compile too (losses within rounding: compiled kernels round otherwise than eager ones)."""
    from fot import presets
    from fot.training.trainer import model_config_from_train_config

    compiled = ("parallel.compile=true", "total_tokens=768", "data.val_tokens=0")
    ref, out, eager = tmp_path / "ref", tmp_path / "run", tmp_path / "eager"
    train(_cfg(ref, *compiled))
    with pytest.raises(TrainingStopped), pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "sigterm_after_step:1")  # SIGTERM while in step 2
        train(_cfg(out, *compiled))
    assert sorted(_losses(out)) == [1, 2]
    train(_cfg(out, *compiled))  # resume=auto picks step 2
    assert _losses(out) == _losses(ref)  # exact float equality, every step
    ckpt = out / "checkpoints" / "step_00000002"
    saved = torch.load(ckpt / "model.pt", weights_only=True)
    plain = set(presets.build_model(model_config_from_train_config(_cfg(out))).state_dict())
    assert set(saved) == plain, sorted(set(saved) ^ plain)
    train(_cfg(eager, "total_tokens=768", "data.val_tokens=0", f"resume={ckpt}"))
    assert _losses(eager)[3] == pytest.approx(_losses(ref)[3], rel=1e-5)


def test_profiled_run_writes_summary_and_trains_the_same(tmp_path, reference_run, caplog) -> None:
    """``profile.steps=1`` profiles the second step; the losses equal the unprofiled run's.
    The summary's ``first_step`` is the run's step number, as in the log, also after a resume
    (it counted from 0 in this process)."""
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=512", "data.val_tokens=0", "profile.steps=1",
               "profile.start_step=1", "profile.trace=false"))  # fmt: skip
    assert _losses(out) == {1: reference_run[1], 2: reference_run[2]}
    summary = json.loads((out / "profile" / "rank0.json").read_text())
    assert summary["steps"] == 1 and summary["first_step"] == 2  # the run's step number
    assert any(name == "aten::mm" for name, _ in summary["top_cpu_ops"])
    assert not (out / "profile" / "rank0.trace.json").exists()
    with pytest.raises(ValueError, match=r"profile\.start_step \+ profile\.steps = 4 but this run"):
        train(_cfg(tmp_path / "bad", "total_tokens=512", "profile.steps=2"))
    # refused before the model is built: no run record, no metrics file (nor a wandb run)
    assert not (tmp_path / "bad" / "run_info.json").exists()
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    # a resumed run counts the steps left after its checkpoint (step 2 of 4 here); too few
    # for the profile, it goes on unprofiled (it was refused: the same command after a stop
    # near the end of a profiled run could not finish it)
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "profile")
    with caplog.at_level(logging.WARNING):
        done = train(_cfg(resumed, "total_tokens=1024", "data.val_tokens=0", "profile.steps=3",
                          "profile.start_step=0"))  # fmt: skip
    assert done["step"] == 4
    note = "profile.start_step + profile.steps = 3 but this run has 2 steps left after its"
    assert f"{note} checkpoint: these steps are not profiled" in caplog.text
    assert not (resumed / "profile").exists()
    # a branch's first start is refused, as a fresh run is
    step2 = out / "checkpoints" / "step_00000002"
    with pytest.raises(ValueError, match=r"steps = 3 but this run has 2 steps left: lower them"):
        train(_cfg(tmp_path / "branch", "total_tokens=1024", "data.val_tokens=0",
                   "profile.steps=3", "profile.start_step=0", f"branch_from={step2}"))  # fmt: skip
    with pytest.raises(ValueError, match=r"profile\.steps and profile\.start_step must be >= 0"):
        train(
            _cfg(tmp_path / "neg", "total_tokens=512", "profile.steps=-1", "profile.start_step=9")
        )
    # the log line names global step numbers, also in a resumed run (steps 3-4 here: the
    # profile is of its second step, step 4; it said "steps 2-2", counted from the resume)
    with caplog.at_level(logging.INFO):
        train(_cfg(out, "total_tokens=1024", "data.val_tokens=0", "profile.steps=1",
                   "profile.start_step=1", "profile.trace=false"))  # fmt: skip
    assert any(
        r.getMessage().startswith(f"profile of steps 4-4 written to {out / 'profile'}")
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    # and so does the summary (it said 1: the second step of this process, counted from 0)
    assert json.loads((out / "profile" / "rank0.json").read_text())["first_step"] == 4


def test_gc_is_manual_while_training(tmp_path, reference_run, monkeypatch) -> None:
    """``gc_every_steps=3``: automatic GC off during the 8 steps, a young-generation collection
    before steps 1, 4 and 7, a full one at the checkpoints after steps 2, 4 and 6 (and one
    before training), automatic GC back on afterwards; the losses are unchanged. The objects
    alive before training are frozen while it runs (each full collection walked all of
    torch's and transformers' again: ~0.2 s), and unfrozen after; a caller's freeze stays."""
    import gc

    calls: list[tuple[tuple, bool, int]] = []
    real_collect = gc.collect

    def collect(*args):
        calls.append((args, gc.isenabled(), gc.get_freeze_count()))
        return real_collect(*args)

    monkeypatch.setattr(gc, "collect", collect)
    out = tmp_path / "run"
    real_collect()
    alive = len(gc.get_objects())  # the oracle: what a freeze now would set aside
    train(_cfg(out, "gc_every_steps=3", "data.val_tokens=0"))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert _losses(out) == reference_run
    young = [enabled for args, enabled, _ in calls if args == (1,)]
    assert young == [False, False, False]
    full = [(enabled, frozen >= 0.9 * alive) for args, enabled, frozen in calls if args == ()]
    assert full == [(True, False), (False, True), (False, True), (False, True)], (alive, calls)
    with pytest.raises(ValueError, match="gc_every_steps must be >= 0"):
        train(_cfg(tmp_path / "bad", "gc_every_steps=-1"))
    assert gc.isenabled()
    gc.freeze()  # the caller's own
    try:
        frozen = gc.get_freeze_count()
        train(_cfg(tmp_path / "frozen", "gc_every_steps=3", "data.val_tokens=0",
                   "total_tokens=256"))  # fmt: skip
        assert gc.get_freeze_count() >= 0.9 * frozen  # not unfrozen (some freed meanwhile)
    finally:
        gc.unfreeze()


_COMMON = ["total_tokens=1024", "ckpt_every_tokens=0", "micro_batch_size=1", "data.val_tokens=256"]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> tuple[Path, dict]:
    single = tmp_path_factory.mktemp("single")
    return single, train(_cfg(single, *_COMMON))


def _fsdp_refused_over_gloo() -> bool:
    """Whether this torch's FSDP2 is refused over gloo (it sums the gradients there)."""
    try:
        check_fsdp_backend("gloo", torch.__version__)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize(
    ("strategy", "launcher"), [("ddp", "torchrun"), ("fsdp", "torchrun"), ("ddp", "srun")]
)
def test_two_processes_equal_one(tmp_path, strategy: str, launcher: str, one_process_run) -> None:
    """Same global batch in one process (2 micro batches) and in two (1 each, gloo).

    DDP runs as two "nodes" joined by torchrun's c10d rendezvous (the multi-node path, here on
    one host); FSDP2 as one node with two processes. ``srun``: two plain ``python train.py``
    processes with the variables srun gives the two tasks of a job step (no torchrun).
    """
    single, res1 = one_process_run
    multi = tmp_path / f"{strategy}-{launcher}"
    script = [
        str(ROOT / "train.py"),
        *SMALL,
        *_COMMON,
        f"parallel={strategy}",
        f"out_dir={multi}",
        f"hydra.run.dir={multi}",
    ]
    run = [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    envs = [env]
    if launcher == "srun":
        launchers = [[sys.executable, *script]] * 2
        envs = srun_environments(2, **env)
    elif strategy == "ddp":
        rdzv = [f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_backend=c10d", "--rdzv_id=t"]
        launchers = [
            [*run, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={n}", *rdzv, *script]
            for n in (0, 1)
        ]
        envs = [env, env]
    else:
        launchers = [[*run, "--standalone", "--nproc_per_node=2", *script]]
    procs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd, e in zip(launchers, envs, strict=True)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    if launcher == "srun":  # rank 0 says what it did; the other says nothing of it
        assert "srun started 2 tasks without torchrun" in outputs[0], outputs[0][-3000:]
        assert "srun started" not in outputs[1]
    if strategy == "fsdp" and _fsdp_refused_over_gloo():
        assert procs[0].returncode != 0 and "parallel=fsdp over gloo needs torch" in outputs[0]
        assert not (multi / "checkpoints").exists()
        return
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[-1][-3000:]
    l1, l2 = _losses(single), _losses(multi)
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5, abs=1e-5), (step, l1, l2)
    g1 = {step: r["grad_norm"] for step, r in _records(single).items()}
    g2 = {step: r["grad_norm"] for step, r in _records(multi).items()}
    # the gradient's scale, which the losses hardly show (Adam's update ignores it): a factor
    # of the world size would be 100%. Tolerance: the float32 norm of sharded gradients rounds
    # differently (~1e-5; the gradients themselves agreed to 1e-9 in a float64 check), and
    # Adam's sign-like first updates amplify weight rounding of ~1e-7 (~1e-4 by step 4)
    assert g2 == pytest.approx(g1, rel=1e-3) and len(g1) == 4
    info = json.loads((multi / "run_info.json").read_text())[0]
    assert info["world_size"] == 2 and info["strategy"] == strategy and info["accum_steps"] == 2
    assert json.loads((single / "run_info.json").read_text())[0]["accum_steps"] == 4
    final = json.loads((multi / "final.json").read_text())
    assert final["val/loss"] == pytest.approx(res1["val/loss"], rel=1e-5)


def test_three_fsdp_processes_over_uneven_shards_train_export_and_resume_as_one(tmp_path) -> None:
    """FSDP2 over 3 processes (gloo) of a model whose rows do not split over 3: a vocabulary of
    50257 rows (pad_vocab_multiple=1), widths of 32 and 50, and 2-row gate and shift weights
    that leave rank 2 no rows. It logs the one-process run's losses; its HF export is its
    final checkpoint, which holds the whole tensors, near the one-process run's weights; its
    step-2 checkpoint resumed in one process logs the one-process run's steps 3 and 4 (a
    sequence read twice or skipped across the change of process count would show)."""
    from transformers import AutoModelForCausalLM

    uneven = [
        "++model.overrides={hidden_size:32,num_hidden_layers:1,num_heads:2,"
        "pad_vocab_multiple:1,intermediate_size:50}",
        "global_batch_tokens=384",  # 6 sequences: 2 per process, 6 micro batches in one
        "micro_batch_size=1",
        "total_tokens=1536",
        "log_every_tokens=384",
        "ckpt_every_tokens=768",
        "data.val_tokens=384",
        "schedule.warmup_tokens=768",
    ]
    single, multi, resumed = tmp_path / "single", tmp_path / "fsdp3", tmp_path / "resumed"
    train(_cfg(single, *uneven, "parallel=single"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(ROOT / "train.py"), *SMALL, *uneven, "parallel=fsdp", "export_hf=true",
           f"out_dir={multi}", f"hydra.run.dir={multi}"]  # fmt: skip
    proc = _run_script(cmd, env_extra={"OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(multi / "checkpoints" / "step_00000004" / "model.pt", weights_only=True)
    want = torch.load(single / "checkpoints" / "step_00000004" / "model.pt", weights_only=True)
    assert ckpt["lm_head.weight"].shape == (50257, 32)
    assert ckpt["model.layers.0.self_attn.fgate_proj.weight"].shape == (2, 32)
    assert ckpt.keys() == want.keys()
    for k, v in ckpt.items():  # a shard put in the wrong rows would be off by the init's 0.02
        assert type(v) is torch.Tensor and torch.allclose(v, want[k], rtol=0, atol=1e-3), k
    exported = AutoModelForCausalLM.from_pretrained(multi / "hf").state_dict()
    assert all(torch.equal(exported[k], v) for k, v in ckpt.items())
    l1, l3 = _records(single), _records(multi)
    assert sorted(l1) == sorted(l3) == [1, 2, 3, 4]
    # tolerances as in test_two_processes_equal_one: losses to float32 reduction order;
    # the logged norm also differs by torch's float32 norm on the CPU, whose error on the
    # 1.6M-entry LM head gradient is ~1e-4 (sharded, its parts are summed more exactly)
    for step in l1:
        assert l3[step]["loss"] == pytest.approx(l1[step]["loss"], abs=1e-5), step
        assert l3[step]["grad_norm"] == pytest.approx(l1[step]["grad_norm"], rel=1e-3), step
    assert json.loads((multi / "run_info.json").read_text())[0]["world_size"] == 3
    train(_cfg(resumed, *uneven, "parallel=single", f"resume={multi}/checkpoints/step_00000002"))
    l1r = _losses(resumed)
    assert sorted(l1r) == [3, 4]
    assert l1r == pytest.approx({s: l1[s]["loss"] for s in (3, 4)}, abs=1e-5)


def test_a_resumed_ddp_processs_first_step_rounds_as_the_uninterrupted_runs_step(
    tmp_path,
) -> None:
    """DDP over 3 processes (gloo) all-reduces a process's first backward in one bucket and
    later ones in rebuilt buckets; an entry's sum over 3 ranks rounds by where it lies in its
    bucket, so a resumed run's first step left the uninterrupted run's weights in the last bit
    (2 ranks add alike in any order, so the 2-process tests saw nothing). After
    settle_ddp_buckets, which the trainer calls before the first step of every start, a
    process's first step gives the gradients of the same step in a process past its first,
    bit for bit; the settling leaves zero gradients and torch's RNG state as it was."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(ROOT / "tests" / "ddp_buckets.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert all(r["equal"] and r["grads_zero"] and r["rng_kept"] for r in ranks), ranks


def test_training_data_smaller_than_a_batch_warns_and_repeated_data_is_noted(
    tmp_path, caplog
) -> None:
    """80 tokens trained a run of 256-token steps without a word (each token ~3 times a step)."""
    caplog.set_level(logging.INFO, logger="fot.train")
    flat = ["data=tokens", "data.packing=causal", "data.val_tokens=0", "total_tokens=512"]
    for n_seqs in (3, 5, 8):  # 4 sequences of 64 per step, 2 steps
        np.save(tmp_path / f"{n_seqs}.npy", np.arange(64 * n_seqs + 1, dtype=np.uint16) % 1000)
        caplog.clear()
        train(_cfg(tmp_path / f"run{n_seqs}", *flat, f"data.path={tmp_path / f'{n_seqs}.npy'}"))
        notes = [
            (r.levelno, r.getMessage())
            for r in caplog.records
            if "training data holds" in r.getMessage()
        ]
        if n_seqs == 3:
            assert notes == [(logging.WARNING, "the training data holds 3 sequences of "
                              "data.seq_len=64 tokens, fewer than one global batch (4 sequences): "
                              "every step reads some of them more than once. Use more data, or a "
                              "smaller global_batch_tokens")]  # fmt: skip
        elif n_seqs == 5:
            assert notes == [(logging.INFO, "the training data holds 5 sequences of "
                              "data.seq_len=64 tokens and the run reads 8: it reads the data 1.6 "
                              "times")]  # fmt: skip
        else:
            assert notes == []


def test_a_bad_token_id_in_one_ranks_share_stops_every_rank_with_the_error(tmp_path) -> None:
    """Rank 1 raised alone on a token id outside the vocabulary in its share of the step; rank
    0 went on into the step's collective and died with a 100-line gloo traceback ("Connection
    closed by peer"; under NCCL and srun it would wait for the timeout). Now every rank stops
    with an error at the same sync and no checkpoint holds a step trained on the clamped ids."""
    ids = np.arange(64 * 40 + 1, dtype=np.int64) % 1000
    ids[64 * 6 + 7] = 60000  # sequence 6 of 4 per step: step 2, the second rank's share
    np.save(tmp_path / "bad.npy", ids)
    run = tmp_path / "run"
    base = [str(ROOT / "train.py"), *SMALL, "data=tokens", "data.packing=causal",
            "total_tokens=1024", "micro_batch_size=1", "log_every_tokens=1024", "parallel=ddp"]  # fmt: skip
    script = [*base, f"data.path={tmp_path / 'bad.npy'}", "data.val_tokens=0",
              f"out_dir={run}", f"hydra.run.dir={run}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def two_ranks_stop(script: list[str]) -> list[str]:
        """Each srun task's stderr, once both stopped with status 2."""
        procs = [
            subprocess.Popen([sys.executable, *script], cwd=tmp_path, env=e, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True)
            for e in srun_environments(2, **env)
        ]  # fmt: skip
        errors = [p.communicate(timeout=300)[1] for p in procs]
        assert [p.returncode for p in procs] == [2, 2], errors[0][-3000:] + errors[1][-3000:]
        assert all("Traceback" not in e for e in errors), errors[0][-3000:]
        return errors

    errors = two_ranks_stop(script)
    assert "train.py (rank 1 of 2): error: the training data of step 2 holds token id 60000, " \
        "outside the model's vocabulary [0, 50257)" in errors[1]  # fmt: skip
    assert "train.py (rank 0 of 2): error: the training data of step 2 of another rank holds " \
        "token ids outside the model's vocabulary [0, 50257) (that rank's error" in errors[0]  # fmt: skip
    # ckpt_every_tokens=512: step 2's checkpoint would have been written before the error
    assert not list_checkpoints(run / "checkpoints")
    # the same in the held-out data: sequence 3 of 4 is the second rank's
    good, held = ids % 1000, ids % 1000
    held[64 * 3 + 7] = 60000
    np.save(tmp_path / "good.npy", good)
    np.save(tmp_path / "held.npy", held)
    val = tmp_path / "val"
    # one step (the error comes in the final validation, after the last step)
    script = [*base, "total_tokens=256", f"data.path={tmp_path / 'good.npy'}",
              "data.val_tokens=256", f"data.val_path={tmp_path / 'held.npy'}", f"out_dir={val}",
              f"hydra.run.dir={val}"]  # fmt: skip
    errors = two_ranks_stop(script)
    assert "(rank 1 of 2): error: the held-out data holds token id 60000" in errors[1]
    assert "(rank 0 of 2): error: the held-out data of another rank holds token ids" in errors[0]


def test_a_full_disk_on_rank_0_stops_every_rank_at_once_with_its_error(tmp_path) -> None:
    """Rank 0 alone writes checkpoints and metrics.jsonl. When a write failed (a full disk),
    rank 0 stopped with its one-line error and the other rank went on into the next collective
    and waited for it: over gloo until rank 0's process had exited (then with a traceback of
    "Connection closed by peer"), over NCCL, which never notices, until the process group's
    timeout (under srun nobody stops it). Now every rank stops at once with rank 0's error;
    the checkpoints written before are complete and nothing cut short is left."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "LINGER_S": "120"}  # fmt: skip
    for point, failed in (("checkpoint:2", "the checkpoint of step 4"),
                          ("metrics:3", "a record of step 3")):  # fmt: skip
        run = tmp_path / point.split(":")[0]
        script = [str(ROOT / "tests" / "full_disk_on_rank0.py"), *SMALL, "parallel=ddp",
                  "total_tokens=1536", "micro_batch_size=1", "data.val_tokens=0",
                  f"out_dir={run}", f"hydra.run.dir={run}"]  # fmt: skip
        procs = [
            subprocess.Popen([sys.executable, *script], cwd=tmp_path, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True, env={**e, "FULL_DISK_AT": point})
            for e in srun_environments(2, **env)
        ]  # fmt: skip
        try:
            # rank 0 lives on for 120 s after its error: the other rank must not wait for it
            other = procs[1].communicate(timeout=90)[1]
            assert procs[0].poll() is None  # still there, as an NCCL peer would be
        finally:
            for p in procs:
                p.kill()
        own = procs[0].communicate()[1]
        assert procs[1].returncode == 2, other[-3000:]
        assert "Traceback" not in other and "Connection closed" not in other, other[-3000:]
        cause = f"cannot write {run}/" + ("checkpoints/.tmp-step_00000004/model.pt" if
                                         "checkpoint" in point else "metrics.jsonl")  # fmt: skip
        assert f"train.py (rank 0 of 2): error: {cause}: No space left on device" in own
        assert (f"train.py (rank 1 of 2): error: rank 0 stopped the run while writing {failed}: "
                if "checkpoint" in point else
                f"train.py (rank 1 of 2): error: rank 0 stopped the run while logging {failed}: "
                ) + f"{cause}: No space left on device" in other  # fmt: skip
        # the earlier checkpoint (step 2) is whole and nothing cut short is left beside it
        assert [c.name for c in list_checkpoints(run / "checkpoints")] == ["step_00000002"]
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
        assert all((run / "checkpoints" / "step_00000002" / n).is_file()
                   for n in ("model.pt", "optim.pt", "rng.pt", "trainer.json"))  # fmt: skip


def test_a_rank_that_waits_out_parallel_timeout_s_stops_with_one_line(tmp_path) -> None:
    """parallel.timeout_s reaches the process group: with 5 s, a rank that waits for one held
    back (rank 0 writing a checkpoint slowly; rank 1 starting late) stops within seconds, not
    after gloo's default 30 minutes, with one line that names the setting and the fix, not
    gloo's C++ message in a traceback."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "SLOW_S": "120"}  # fmt: skip
    for point, waiting, where in (("checkpoint:1", 1, " while writing the checkpoint of step 2"),
                                  ("start", 0, "")):  # fmt: skip
        run = tmp_path / point.split(":")[0]
        script = [str(ROOT / "tests" / "slow_rank.py"), *SMALL, "parallel=ddp",
                  "parallel.timeout_s=5", "total_tokens=1536", "micro_batch_size=1",
                  "data.val_tokens=0", f"out_dir={run}", f"hydra.run.dir={run}"]  # fmt: skip
        procs = [
            subprocess.Popen([sys.executable, *script], cwd=tmp_path, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True, env={**e, "SLOW_AT": point})
            for e in srun_environments(2, **env)
        ]  # fmt: skip
        try:
            # the other rank is held for 120 s: the waiting one must stop well before that
            err = procs[waiting].communicate(timeout=60)[1]
            assert procs[1 - waiting].poll() is None
        finally:
            for p in procs:
                p.kill()
        procs[1 - waiting].communicate()
        assert procs[waiting].returncode == 2, err[-3000:]
        assert "Traceback" not in err and "gloo" not in err, err[-3000:]
        assert (f"train.py (rank {waiting} of 2): error: waited longer than "
                f"parallel.timeout_s=5 seconds for the other ranks{where}, and one of them did "
                "not come: it stalled or died (see its output). If a rank was busy that long on "
                "its own (rank 0 writing a checkpoint to a slow file system or exporting a big "
                "model), raise parallel.timeout_s\n") in err, err[-3000:]  # fmt: skip
    # rank 0 never starts (its node died, or MASTER_ADDR names another host): rank 1 gave
    # the store client's DistNetworkError in a traceback (helper-179)
    run = tmp_path / "no_rank_0"
    rank_1 = srun_environments(2, **env)[1]
    script = [str(ROOT / "train.py"), *SMALL, "parallel=ddp", "parallel.timeout_s=5",
              f"out_dir={run}", f"hydra.run.dir={run}"]  # fmt: skip
    done = subprocess.run([sys.executable, *script], cwd=tmp_path, capture_output=True,
                          text=True, env=rank_1, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (f"train.py (rank 1 of 2): error: waited longer than parallel.timeout_s=5 seconds to "
            f"reach rank 0 at localhost:{rank_1['MASTER_PORT']} (MASTER_ADDR, MASTER_PORT), "
            "where the processes of the run meet at the start: rank 0 did not start, or stopped "
            "before the others came (see its output), or that address is not rank 0's host\n"
            ) in done.stderr, done.stderr[-3000:]  # fmt: skip


def _two_srun_tasks(tmp_path: Path, run: Path, *overrides: str, **env_extra: str) -> list:
    """Run train.py as two srun-like tasks (parallel=ddp over gloo, 8 steps of 256 tokens, a
    checkpoint every 2) in ``run``; return ``(exit status, stderr)`` of each rank."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           **env_extra}  # fmt: skip
    script = [str(ROOT / "train.py"), *SMALL, "parallel=ddp", "micro_batch_size=1",
              "data.val_tokens=0", f"out_dir={run}", f"hydra.run.dir={run}", *overrides]  # fmt: skip
    # a shell's background job (`bash .ci/run &`) ignores SIGINT, and so would the tasks: a
    # SIGINT to one of them (sigint_after_step) must act as Ctrl-C does in a terminal
    procs = [
        subprocess.Popen([sys.executable, *script], cwd=tmp_path, stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True, env=e,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        for e in srun_environments(2, **env)
    ]  # fmt: skip
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, e) for p, e in zip(procs, errors, strict=True)]


def _whole_checkpoints(run: Path) -> list[str]:
    """The names of the run's checkpoints, after checking each is complete and nothing cut
    short lies beside them."""
    names = [c.name for c in list_checkpoints(run / "checkpoints")]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == names
    for name in names:
        assert all((run / "checkpoints" / name / n).is_file()
                   for n in ("model.pt", "optim.pt", "rng.pt", "trainer.json"))  # fmt: skip
    return names


@pytest.mark.parametrize("interrupted", [1, 0])
def test_ctrl_c_to_one_rank_stops_the_other_with_one_line(tmp_path, interrupted: int) -> None:
    """SIGINT to one process of the run (``kill -INT <pid>``, a scheduler signalling one task)
    stops it at once, as Ctrl-C does. The other one waited in its next collective until gloo
    noticed the process had gone, then printed ~100 lines of gloo's "Connection closed by
    peer" traceback. Now it prints one line that names the interrupted rank (which says so in
    the process group's store before it exits: a rank other than 0 prints nothing, as on a
    Ctrl-C to every rank), and rank 0 says what the run kept and how to continue; the
    checkpoints written before are whole."""
    run = tmp_path / "run"
    ranks = _two_srun_tasks(tmp_path, run, **{FAULT_ENV: f"sigint_after_step:3:{interrupted}"})
    other = 1 - interrupted
    assert ranks[interrupted][0] == 130 and ranks[other][0] == 2, ranks[other][1][-3000:]
    assert all("Traceback" not in e and "Connection closed" not in e for _, e in ranks), ranks
    assert _whole_checkpoints(run) == ["step_00000002"]  # step 3 is lost, as on Ctrl-C
    kept = (f"the latest checkpoint is {run}/checkpoints/step_00000002 (later steps are lost): "
            f"run the same command with out_dir={run} to continue from it (resume=auto)")  # fmt: skip
    named = (f"train.py (rank {other} of 2): error: rank {interrupted} was interrupted (Ctrl-C "
             "or SIGINT to it) while this one waited for it in a collective, and this one stops "
             "too")  # fmt: skip
    if interrupted == 1:  # silent: the other ranks of a Ctrl-C in a terminal say nothing
        assert ranks[1][1] == ""
        assert f"{named}; the run stopped; {kept}\n" in ranks[0][1], ranks[0][1][-3000:]
    else:
        assert f"train.py: interrupted; {kept}\n" in ranks[0][1], ranks[0][1][-3000:]
        # rank 0's store outlives its gloo connections by a moment; where it is gone first
        # rank 1 can say no more than that rank 0 exited
        gone = ("train.py (rank 1 of 2): error: rank 0 exited while this one waited for it in "
                "a collective, and this one stops too: its output, or the launcher's summary of "
                "exit codes (130: Ctrl-C or SIGINT to it), says why")  # fmt: skip
        assert ranks[1][1].startswith((f"{named}\n(set HYDRA", f"{gone}\n(set HYDRA")), ranks[1][1]


def test_a_killed_rank_0_is_named_by_the_other_rank(tmp_path) -> None:
    """Rank 0 killed (SIGKILL: the out-of-memory killer) says nothing, and the store of the
    run's process group, which lives in its process, is gone with it: the other rank says
    that rank 0 exited, where it said "another process of the run", in one line."""
    run = tmp_path / "run"
    ranks = _two_srun_tasks(tmp_path, run, **{FAULT_ENV: "kill_after_step:3"})
    assert ranks[0][0] == -signal.SIGKILL and ranks[1][0] == 2, ranks[1][1][-3000:]
    assert ranks[1][1] == (
        "train.py (rank 1 of 2): error: rank 0 exited while this one waited for it in a "
        "collective, and this one stops too: its output, or the launcher's summary of exit "
        "codes (130: Ctrl-C or SIGINT to it), says why\n(set HYDRA_FULL_ERROR=1 for the "
        "traceback)\n"
    )
    assert _whole_checkpoints(run) == ["step_00000002"]


_STORE_HOST_STOPPED = """
import os, sys, time
import torch.distributed as dist
from fot.training.parallel import other_rank_gone, record_interrupted

dist.init_process_group("gloo")
dist.barrier()
print("ready", flush=True)
if dist.get_rank() == 0:
    time.sleep(120)  # stopped here by the test (SIGSTOP): alive, but its store answers nothing
sys.stdin.readline()  # rank 0 is stopped
start = time.perf_counter()
record_interrupted()
print(f"recorded after {time.perf_counter() - start:.1f} s", flush=True)
start = time.perf_counter()
err = other_rank_gone(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
print(f"{err} (after {time.perf_counter() - start:.1f} s)", flush=True)
print("stderr is back", file=sys.stderr, flush=True)
"""


def _two_ranks_of(code: str, **popen: object) -> list[subprocess.Popen]:
    """Two processes running ``python -c code`` as ranks 0 and 1 of a gloo group on this host
    (``env://`` variables set), their stdout and stderr piped as text."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    return [
        subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        for rank in (0, 1)
    ]  # fmt: skip


def test_a_rank_stops_though_the_store_of_the_group_does_not_answer(tmp_path) -> None:
    """Ctrl-C to one rank notes it in the process group's store, which srun's tasks keep in
    rank 0's process. Where that process was alive but did not answer (stopped, as under a
    debugger, or on a host cut off), the Ctrl-C'd rank waited for the store forever and no
    further Ctrl-C stopped it, nor a rank naming the one gone after gloo's error. Now each
    waits at most 2 s for the store's answer, then stops; the rank gone is not named."""
    procs = _two_ranks_of(_STORE_HOST_STOPPED, stdin=subprocess.PIPE)
    try:
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
        procs[0].send_signal(signal.SIGSTOP)
        # the stop is asynchronous: until every thread of rank 0 has stopped, its store thread
        # may still answer (1 run in 16 under load answered at once); waitpid reports the stop
        _, status = os.waitpid(procs[0].pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        out, err = procs[1].communicate("go\n", timeout=30)
        assert procs[1].returncode == 0, err[-3000:]
        gone = (
            "another process of the run exited while this one waited for it in a collective, "
            "and this one stops too: that process's output, or the launcher's summary of exit "
            "codes (130: Ctrl-C or SIGINT to it), says which one and why"
        )
        found = re.fullmatch(
            rf"recorded after ([\d.]+) s\n{re.escape(gone)} \(after ([\d.]+) s\)\n", out
        )
        assert found and all(1.9 <= float(s) < 10 for s in found.groups()), out
        # (a rank that started before rank 0 listened may warn of its retries first)
        assert err.endswith("\nstderr is back\n") or err == "stderr is back\n", err[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_a_run_lock_that_rank_0_cannot_open_stops_every_rank_with_its_error(tmp_path) -> None:
    """Rank 0 alone takes the run folder's lock. An error there other than "in use" (the lock
    file unwritable: here a folder of its name) stopped rank 0 with Python's message while
    rank 1 waited for it in a broadcast (over gloo until rank 0 had exited, then with gloo's
    traceback; over NCCL until the timeout). Now both stop at once with one line naming the
    file, and nothing is written."""
    run = tmp_path / "run"
    (run / ".run.lock").mkdir(parents=True)
    ranks = _two_srun_tasks(tmp_path, run)
    assert [code for code, _ in ranks] == [2, 2], ranks[1][1][-3000:]
    assert all("Traceback" not in e and "Connection closed" not in e for _, e in ranks), ranks
    cause = (f"cannot write {run}/.run.lock: Is a directory. It keeps a second run out of this "
             "folder: pass another out_dir=...")  # fmt: skip
    assert f"train.py (rank 0 of 2): error: {cause}\n" in ranks[0][1], ranks[0][1][-3000:]
    assert (f"train.py (rank 1 of 2): error: rank 0 stopped the run while taking the run "
            f"folder's lock: {cause}\n") in ranks[1][1], ranks[1][1][-3000:]  # fmt: skip
    assert sorted(p.name for p in run.iterdir()) == [".run.lock", "train.log"]  # Hydra's log


def test_records_rank_0_cannot_read_on_a_two_rank_resume_stop_every_rank_with_its_error(
    tmp_path,
) -> None:
    """resume=<another folder's last checkpoint> reads that run's metrics.jsonl on rank 0
    alone (its training record of that step, for final.json), and the other ranks wait for it
    in a broadcast. Where rank 0 could not read it, a folder in its place was taken for no
    records at all, and bytes that are not text stopped rank 0 with Python's "'utf-8' codec
    can't decode byte 0xff" without the file's name. Now every rank stops at once with one
    line naming the file, and neither run folder is changed. (The run resumed from is trained
    here, in this process, at the batch of the two tasks: only its folder is read.)"""
    first, second = tmp_path / "first", tmp_path / "second"
    train(_cfg(first, "total_tokens=512", "micro_batch_size=1", "data.val_tokens=0"))
    records = first / "metrics.jsonl"
    text = records.read_bytes()
    kept = tmp_path / "metrics.jsonl"
    records.rename(kept)
    for why, make in (("Is a directory", records.mkdir),
                      ("byte 3 is not UTF-8 text (invalid start byte)",
                       lambda: records.write_bytes(b'{"s\xfftep": 2}\n' + text))):  # fmt: skip
        make()
        ranks = _two_srun_tasks(
            tmp_path, second, "total_tokens=512", f"resume={first}/checkpoints/step_00000002"
        )
        assert [code for code, _ in ranks] == [2, 2], ranks[1][1][-3000:]
        assert all("Traceback" not in e and "Connection closed" not in e for _, e in ranks), ranks
        cause = (f"cannot read {records}: {why}. It holds a run's training and validation "
                 "records: make it a readable file again, or move it aside to go on without "
                 "them")  # fmt: skip
        assert f"train.py (rank 0 of 2): error: {cause}\n" in ranks[0][1], ranks[0][1][-3000:]
        assert (f"train.py (rank 1 of 2): error: rank 0 stopped the run while reading "
                f"{records}: {cause}\n") in ranks[1][1], ranks[1][1][-3000:]  # fmt: skip
        assert not (second / "checkpoints").exists() and not (second / "final.json").exists()
        if records.is_dir():
            assert not list(records.iterdir())
            records.rmdir()
        else:
            assert records.read_bytes() == b'{"s\xfftep": 2}\n' + text
    assert kept.read_bytes() == text
    assert _whole_checkpoints(first) == ["step_00000002"]


def test_a_records_file_that_cannot_be_written_is_named_with_the_fix(tmp_path) -> None:
    """``metrics.jsonl`` left as a symbolic link into a folder that is gone (a moved scratch
    disk) stopped the run with "[Errno 2] No such file or directory: '.../metrics.jsonl'",
    naming a file that ``ls`` shows. Now the message says it is a link and where to, and the
    link is left as it was."""
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "gone" / "metrics.jsonl"
    (run / "metrics.jsonl").symlink_to(target)
    with pytest.raises(ValueError) as err:
        train(_cfg(run))
    assert str(err.value) == (
        f"cannot write {run}/metrics.jsonl: No such file or directory (it is a symbolic link "
        f"to {target}). It holds the run's training and validation records: make it a "
        "writable file (or a link to one) again, or move it aside"
    )
    assert os.readlink(run / "metrics.jsonl") == str(target) and not target.parent.exists()
    assert not (run / "checkpoints").exists()


def test_a_profile_one_rank_cannot_write_stops_every_rank_with_its_error(tmp_path) -> None:
    """Every rank writes its own profile files. Where one rank's write failed (here its
    ``rank1.json`` is a folder), that rank stopped with Python's message and the other went on
    into the next collective and waited for it, then printed gloo's traceback. Now every rank
    stops with one line naming the file; the checkpoints written before are whole."""
    run = tmp_path / "run"
    (run / "profile" / "rank1.json").mkdir(parents=True)
    ranks = _two_srun_tasks(tmp_path, run, "profile.steps=2", "profile.start_step=1")
    assert [code for code, _ in ranks] == [2, 2], ranks[0][1][-3000:]
    assert all("Traceback" not in e and "Connection closed" not in e for _, e in ranks), ranks
    cause = f"cannot write {run}/profile/rank1.json: Is a directory"
    assert f"train.py (rank 1 of 2): error: {cause}\n" in ranks[1][1], ranks[1][1][-3000:]
    assert (f"train.py (rank 0 of 2): error: rank 1 stopped the run while writing the profile "
            f"of steps 2-3: {cause}\n") in ranks[0][1], ranks[0][1][-3000:]  # fmt: skip
    assert _whole_checkpoints(run) == ["step_00000002"]
    assert (run / "profile" / "rank0.json").is_file()


@pytest.mark.gpu
def test_ddp_on_a_gpu_resumes_bit_identical(tmp_path) -> None:
    """Eager DDP on a GPU, stopped by SIGTERM after step 5 and resumed, logs the losses and
    gradient norms of the uninterrupted run and ends on its weights, bit for bit. Two tasks
    share one GPU over gloo (NCCL takes one process per GPU), so a one-GPU machine checks it.
    DDP rebuilds its gradient buckets after a run's first step: the resumed run's step 6
    reads its gradients at other addresses than the uninterrupted run's step 6 (which is why
    fot's gradient clip does not depend on them; here both clips happen to agree)."""
    paths = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    gpu = {"CUDA_VISIBLE_DEVICES": (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0],
           "PYTHONPATH": paths}  # fmt: skip
    on_gpu = ("device=cuda", "parallel.backend=gloo")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    ranks = _two_srun_tasks(tmp_path, whole, *on_gpu, **gpu)
    assert [code for code, _ in ranks] == [0, 0], ranks[0][1][-3000:] + ranks[1][1][-3000:]
    ranks = _two_srun_tasks(
        tmp_path, stopped, *on_gpu, **gpu, **{FAULT_ENV: "sigterm_after_step:4"}
    )
    assert [code for code, _ in ranks] == [143, 143], ranks[0][1][-3000:] + ranks[1][1][-3000:]
    assert list_checkpoints(stopped / "checkpoints")[-1].name == "step_00000005"
    ranks = _two_srun_tasks(tmp_path, stopped, *on_gpu, **gpu)
    assert [code for code, _ in ranks] == [0, 0], ranks[0][1][-3000:] + ranks[1][1][-3000:]
    a, b = _records(whole), _records(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert [(a[s]["loss"], a[s]["grad_norm"]) for s in a] == [
        (b[s]["loss"], b[s]["grad_norm"]) for s in a
    ]
    final = list_checkpoints(whole / "checkpoints")[-1].name
    wa = torch.load(whole / "checkpoints" / final / "model.pt")
    wb = torch.load(stopped / "checkpoints" / final / "model.pt")
    assert final == "step_00000008" and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.gpu
def test_srun_tasks_on_two_gpus_train_as_torchrun_does(tmp_path) -> None:
    """Two srun-like tasks on two GPUs (NCCL), each seeing both GPUs (``LOCAL_RANK`` picks
    one) or only its own (``--gpus-per-task=1``: device 0 of each), log the same losses as
    torchrun's two processes."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]  # (packages installed there too)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": os.pathsep.join(paths)}
    visible = env.get("CUDA_VISIBLE_DEVICES") or ",".join(
        map(str, range(torch.cuda.device_count()))
    )
    args = [*SMALL, *_COMMON, "device=cuda", "parallel=ddp"]
    runs = {}
    for launch in ("torchrun", "srun", "srun-one-gpu-each"):
        out = tmp_path / launch
        script = [str(ROOT / "train.py"), *args, f"out_dir={out}", f"hydra.run.dir={out}"]
        if launch == "torchrun":
            cmds = [[sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc_per_node=2", *script]]  # fmt: skip
            envs = [env]
        else:
            cmds = [[sys.executable, *script]] * 2
            envs = srun_environments(2, **env)
            if launch == "srun-one-gpu-each":
                gpus = visible.split(",")
                envs = [{**e, "CUDA_VISIBLE_DEVICES": gpus[t]} for t, e in enumerate(envs)]
        procs = [
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for cmd, e in zip(cmds, envs, strict=True)
        ]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[-1][-3000:]
        assert json.loads((out / "run_info.json").read_text())[0]["world_size"] == 2
        runs[launch] = _losses(out)
    assert len(runs["torchrun"]) == 4
    assert runs["srun"] == runs["torchrun"] == runs["srun-one-gpu-each"]


def test_multirun_under_torchrun_one_folder_per_job(tmp_path) -> None:
    # two jobs in the same two processes: the process group is created once and reused
    sweep = tmp_path / "sweep"
    proc = _run_script(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "train.py"),
            "-m",
            "model=fot_pro,transformer_pro",
            *SMALL,
            "total_tokens=256",
            "micro_batch_size=1",
            "data.val_tokens=0",
            f"hydra.sweep.dir={sweep}",
        ],
        env_extra={"OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Hydra's lines once (rank 0's), not once per rank
    out = proc.stdout + proc.stderr
    assert out.count("Launching 2 jobs locally") == 1 and out.count("#1 : model=") == 1, out
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert [p.name for p in jobs] == ["0", "1"]
    names = [
        json.loads((p / "run_info.json").read_text())[0]["config"]["model"]["name"] for p in jobs
    ]
    assert names == ["fot_pro", "transformer_pro"]
    for p in jobs:
        assert list_checkpoints(p / "checkpoints")
        assert json.loads((p / "run_info.json").read_text())[0]["world_size"] == 2


def test_a_multirun_under_torchrun_refuses_a_second_timeout_for_its_one_group(tmp_path) -> None:
    """The jobs of a multirun under torchrun share one process group, made by the first job
    with its parallel.timeout_s, which the group keeps: a later job that asks for another
    stops on every rank with one line that says so, instead of running with the first's."""
    sweep = tmp_path / "sweep"
    proc = _run_script(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "train.py"), "-m", "parallel.timeout_s=600,1200", *SMALL, "total_tokens=256",
         "micro_batch_size=1", "data.val_tokens=0", f"hydra.sweep.dir={sweep}"],
        env_extra={"OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stderr[-4000:]
    assert (sweep / "0" / "metrics.jsonl").is_file()  # the first job trained
    assert not (sweep / "1" / "metrics.jsonl").exists()
    for rank in (0, 1):
        assert (f"train.py (rank {rank} of 2): error: parallel.timeout_s=1200, but an earlier "
                "job of this multirun made this process's group with parallel.timeout_s=600, "
                "and a process group keeps the timeout it was made with: give every job of the "
                "sweep the same parallel.timeout_s, or run the jobs as separate torchrun "
                "commands\n") in proc.stderr, proc.stderr[-4000:]  # fmt: skip


def _poison_after(monkeypatch, micro_batches: int) -> None:
    """Make the model's loss NaN from micro batch ``micro_batches + 1`` on (2 per step)."""
    from fot import presets

    real_build = presets.build_model
    calls = {"n": 0}

    def poisoned_build(config):
        model = real_build(config)

        def hook(module, args, kwargs, output):
            calls["n"] += 1
            if calls["n"] > micro_batches:
                output.loss = output.loss * float("nan")
            return output

        model.register_forward_hook(hook, with_kwargs=True)
        return model

    monkeypatch.setattr(presets, "build_model", poisoned_build)


def test_nan_loss_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch) -> None:
    _poison_after(monkeypatch, 6)  # micro batches 7+ (step 4 onwards) diverge
    out = tmp_path / "run"
    with pytest.raises(TrainingDivergedError, match=r"step 4 .*step_00000002.*untouched"):
        train(_cfg(out))
    ckpts = list_checkpoints(out / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000002"]
    assert json.loads((ckpts[0] / "trainer.json").read_text())["step"] == 2


def test_nan_between_log_boundaries_is_caught_before_the_next_checkpoint(
    tmp_path, monkeypatch
) -> None:
    # logs at steps 6 and 8 only, checkpoints at 2, 4, 6; step 3 is the first NaN step: the
    # check runs lazily at the step-4 checkpoint boundary, before anything is written
    _poison_after(monkeypatch, 4)
    out = tmp_path / "run"
    with pytest.raises(TrainingDivergedError) as err:
        train(_cfg(out, "log_every_tokens=1536", "ckpt_every_tokens=512"))
    msg = str(err.value)
    assert "loss=nan" in msg and "at step 3 (tokens 768," in msg, msg
    assert "found at step 4" in msg and "steps 3-4 are lost" in msg, msg
    assert "step_00000002) is untouched" in msg and "lower optim.lr" in msg, msg
    ckpts = list_checkpoints(out / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000002"]  # no step-4 checkpoint with NaN weights
    assert not list((out / "checkpoints").glob(".tmp-*"))
    state = torch.load(ckpts[0] / "model.pt", map_location="cpu", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    assert (
        not (out / "metrics.jsonl").exists() or "loss" not in (out / "metrics.jsonl").read_text()
    )  # no training record was logged before the stop


# Tensor -> Python conversions; on a GPU each one waits for the device (a host sync).
_SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
# Conversions made below these folders are host-only: the label counts of the CPU batches
# (before they are copied to the device), and CPU AdamW's step counters (the fused CUDA AdamW
# used on GPU keeps them on the device and reads none).
_HOST_ONLY = (f"{os.sep}fot{os.sep}data{os.sep}", f"{os.sep}torch{os.sep}optim{os.sep}")


def _count_syncs(monkeypatch) -> dict:
    """Patch the conversions; count them per training step (key = step, None outside steps)."""
    import fot.training.trainer as trainer_mod
    from fot.data.streams import SequenceStream

    where: dict = {"step": None, "counts": {}, "n_tokens": {}}

    def counted(name):
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                if any(s in frame.f_code.co_filename for s in _HOST_ONLY):
                    break
                frame = frame.f_back
            else:
                step = where["step"]
                where["counts"][step] = where["counts"].get(step, 0) + 1
            return orig(self, *args, **kwargs)

        return wrapper

    for name in _SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    real_next, real_fault = SequenceStream.next_step, trainer_mod.ckpt._fault

    def next_step(self):
        where["step"] = self.position // self.global_batch_size + 1
        batches = real_next(self)
        where["n_tokens"][where["step"]] = sum(b.num_label_tokens() for b in batches)
        return batches

    def fault(point, step):
        if point == "kill_after_step":
            where["step"] = None
        return real_fault(point, step)

    monkeypatch.setattr(SequenceStream, "next_step", next_step)
    monkeypatch.setattr(trainer_mod.ckpt, "_fault", fault)
    return where


def _records(out_dir: Path) -> dict[int, dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def test_no_host_sync_between_boundaries(tmp_path, monkeypatch) -> None:
    # padded packing of short documents: label counts differ between steps (the logged loss is
    # token-weighted) and there is no cu_seqlens (the model's varlen path checks it on the host)
    from fot.data import sample

    real_docs = sample.sample_token_documents

    def short_docs(split="all", escaping="none"):
        docs = list(real_docs(split, escaping))[:3]
        return [d[i : i + 7 + i % 53] for d in docs for i in range(0, 6000, 60)]

    monkeypatch.setattr(sample, "sample_token_documents", short_docs)
    common = ["data.packing=padded", "total_tokens=3072", "val_every_tokens=2560"]
    common += ["ckpt_every_tokens=1536", "data.val_tokens=64"]
    # oracle: the same run logging every step
    every = tmp_path / "every"
    counts_every = _count_syncs(monkeypatch)
    train(_cfg(every, *common, "log_every_tokens=256"))
    per_step, n_tok = _records(every), counts_every["n_tokens"]
    assert sorted(per_step) == list(range(1, 13))
    assert len(set(n_tok.values())) > 1, n_tok  # the weighting matters

    out = tmp_path / "sparse"
    counts = _count_syncs(monkeypatch)
    train(_cfg(out, *common, "log_every_tokens=1024"))
    recs = _records(out)
    logs, ckpts, vals = {4, 8, 12}, {6}, {10}
    assert sorted(recs) == sorted(logs)
    c = counts["counts"]
    for step in range(1, 13):
        if step in logs:
            assert c.get(step, 0) == 1, (step, c)  # one transfer per log record
        elif step in ckpts | vals:
            assert c.get(step, 0) >= 1, (step, c)
        else:
            assert c.get(step, 0) == 0, (step, c)  # no host sync in a plain step
    # the logged values are the same as before: token-weighted window loss, last grad norm
    for end in logs:
        window = range(end - 3, end + 1)
        want = sum(per_step[k]["loss"] * n_tok[k] for k in window) / sum(n_tok[k] for k in window)
        assert recs[end]["loss"] == pytest.approx(want, rel=1e-12)
        assert recs[end]["grad_norm"] == per_step[end]["grad_norm"]
        assert recs[end]["lr"] == per_step[end]["lr"] and recs[end]["tokens"] == end * 256
        assert recs[end]["tokens_per_s"] > 0


def test_lr_schedule_in_tokens() -> None:
    cfg = ScheduleConfig(name="warmup_cosine", warmup_tokens=100, min_lr_ratio=0.1)
    assert lr_at(50, peak_lr=1.0, total_tokens=1100, cfg=cfg) == pytest.approx(0.5)
    assert lr_at(100, peak_lr=1.0, total_tokens=1100, cfg=cfg) == pytest.approx(1.0)
    assert lr_at(600, peak_lr=1.0, total_tokens=1100, cfg=cfg) == pytest.approx(0.55)
    assert lr_at(1100, peak_lr=1.0, total_tokens=1100, cfg=cfg) == pytest.approx(0.1)
    lin = ScheduleConfig(name="warmup_linear", warmup_tokens=0, min_lr_ratio=0.0)
    assert lr_at(250, peak_lr=2.0, total_tokens=1000, cfg=lin) == pytest.approx(1.5)
    # the linear decay ends at the floor, not at 0 (schedule=warmup_linear's min_lr_ratio 0.1):
    # halfway from the warmup's end to total_tokens, 1 - 0.9 * 0.5 of the peak
    lin = ScheduleConfig(name="warmup_linear", warmup_tokens=100, min_lr_ratio=0.1)
    assert lr_at(50, peak_lr=1.0, total_tokens=1100, cfg=lin) == pytest.approx(0.5)
    assert lr_at(600, peak_lr=1.0, total_tokens=1100, cfg=lin) == pytest.approx(0.55)
    assert lr_at(1100, peak_lr=1.0, total_tokens=1100, cfg=lin) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_cosine"):
        lr_at(0, peak_lr=1.0, total_tokens=1, cfg=ScheduleConfig(name="cosine"))


def test_wsd_schedule_by_hand() -> None:
    """Warmup to 100 tokens, the peak to 800, then the decay over the last 200 tokens of 1000
    to 0.1 × the peak, in each shape (values computed by hand)."""
    cfg = dict(name="wsd", warmup_tokens=100, min_lr_ratio=0.1, decay_fraction=0.2)
    expected = {  # progress 0.25 and 0.5 through the decay
        "linear": (0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.5),
        "cosine": (0.1 + 0.9 * (1 + 2**-0.5) / 2, 0.1 + 0.9 * 0.5),
        "1-sqrt": (0.1 + 0.9 * 0.5, 0.1 + 0.9 * (1 - 2**-0.5)),
    }
    for shape, (at_850, at_900) in expected.items():
        sched = ScheduleConfig(**cfg, decay_shape=shape)

        def lr(tokens: int, sched: ScheduleConfig = sched) -> float:
            return lr_at(tokens, peak_lr=2.0, total_tokens=1000, cfg=sched)

        assert lr(50) == pytest.approx(1.0) and lr(100) == 2.0
        assert lr(500) == lr(800) == 2.0  # stable
        assert lr(850) == pytest.approx(2.0 * at_850) and lr(900) == pytest.approx(2.0 * at_900)
        assert lr(1000) == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"needs schedule\.decay_shape; pick the group"):
        lr_at(950, peak_lr=1.0, total_tokens=1000, cfg=ScheduleConfig(**cfg))


@pytest.mark.parametrize("packing", ["causal", "padded"])
def test_two_steps_are_adamw_steps_on_the_clipped_mean_loss_by_hand(tmp_path, packing) -> None:
    """The training step against one written out here: the mean cross entropy over the labels
    of the global batch that count (the loop accumulates it over 2 micro batches; padded rows
    give them different label counts), its gradient's norm before clipping (logged as
    grad_norm), clipped to optim.grad_clip, then torch's AdamW at the LR of the tokens seen
    including the step, weight decay on matrices only. Both steps clip (their norms exceed
    0.5) by different factors, so the second AdamW step shows whether they were clipped; the
    first moves every weight by about the LR whatever the gradient's scale."""
    from transformers import AutoModelForCausalLM

    from fot import presets
    from fot.data.tokens import write_token_documents

    torch.manual_seed(1)
    init = tmp_path / "init"
    presets.build_model(presets.config("fot_pro", "tiny", hidden_size=32, num_hidden_layers=1,
                                       num_heads=2)).save_pretrained(init)  # fmt: skip
    rng = np.random.default_rng(0)
    if packing == "causal":  # a flat token file: sequence g is tokens[64 g : 64 g + 65]
        tokens = rng.integers(0, 1000, 8 * 64 + 1).astype(np.uint16)
        np.save(data := tmp_path / "tokens.npy", tokens)
        rows = [tokens[g * 64 : g * 64 + 65] for g in range(8)]
    else:  # one document a row: BOS, the document, EOT, cut to 65 tokens; then -100 labels
        docs = [rng.integers(0, 1000, n) for n in (10, 63, 100, 30, 5, 64, 20, 40)]
        write_token_documents(data := tmp_path / "docs", docs)
        rows = [np.array([50256, *d, 50256][:65]) for d in docs]
    out = tmp_path / "run"
    train(_cfg(out, "data=tokens", f"data.packing={packing}", "data.val_tokens=0",
               f"data.path={data}", "total_tokens=512", f"init_from={init}",
               "optim.grad_clip=0.5", "log_every_tokens=256"))  # fmt: skip
    recs = _records(out)

    model = AutoModelForCausalLM.from_pretrained(init)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for step, lr in ((1, 0.01 * 256 / 512), (2, 0.01)):  # warmup of 512 tokens, 256 a step
        x = torch.full((4, 65), 50256)
        y = torch.full((4, 64), -100)
        for i, row in enumerate(rows[4 * step - 4 : 4 * step]):
            x[i, : len(row)] = torch.from_numpy(row.astype(np.int64))
            y[i, : len(row) - 1] = x[i, 1 : len(row)]
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        assert norm > 0.6  # clipped
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad()
        assert recs[step]["lr"] == pytest.approx(lr, rel=1e-12)
        assert recs[step]["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert recs[step]["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    got = torch.load(out / "checkpoints" / "step_00000002" / "model.pt", weights_only=True)
    want = model.state_dict()
    assert got.keys() == want.keys()
    # AdamW divides by the gradient's size: rounding in gradients near 0 (the loop sums 2 micro
    # batches) moves a weight by up to ~1e-5; unclipped steps differ by 1e-3 and more
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=5e-5, msg=key)


def test_wsd_branch_trains_as_a_run_planned_at_its_length(tmp_path) -> None:
    """The point of warmup-stable-decay: a run branched from a stable-phase checkpoint of a
    longer run (branch_from=<its checkpoint>, a shorter total_tokens) trains step for step as
    a run planned at the shorter length from the start. Stopped by SIGTERM, the same command
    (branch_from and all: a requeued job) continues from the branch's own checkpoint, also
    once branch_from is gone (it was refused as missing)."""
    wsd = ("schedule=wsd", "schedule.warmup_tokens=256", "schedule.decay_fraction=0.25")
    long = tmp_path / "long"
    train(_cfg(long, *wsd, "total_tokens=3072", "ckpt_every_tokens=1024", "keep_last=3"))
    planned = tmp_path / "planned"
    train(_cfg(planned, *wsd, "total_tokens=2048"))
    branch = tmp_path / "branch"
    step4 = long / "checkpoints" / "step_00000004"  # stable in both (decay from 2304 / 1536)
    command = _cfg(branch, *wsd, "total_tokens=2048", f"branch_from={step4}")
    with pytest.raises(TrainingStopped) as stopped, pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "sigterm_after_step:5")
        train(command)
    assert stopped.value.checkpoint.parent == branch / "checkpoints"
    assert str(stopped.value).endswith("to continue from it (resume=auto)")  # the same command
    # meanwhile the longer run's keep_last rotated the branch point away: it is not read
    shutil.rmtree(step4)
    assert train(command)["step"] == 8
    assert not list(branch.glob("checkpoints/.abandoned-*"))

    def records(out: Path) -> dict[int, dict]:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

    want, got, longer = records(planned), records(branch), records(long)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert (got[step]["loss"], got[step]["lr"]) == (want[step]["loss"], want[step]["lr"])
    # the schedule itself, by hand: peak 0.01 until 1536 tokens, then 1 - sqrt(progress) to 0
    assert [want[k]["lr"] for k in (1, 6, 7, 8)] == pytest.approx(
        [0.01, 0.01, 0.01 * (1 - 0.5**0.5), 0.0]
    )
    assert longer[7]["lr"] == 0.01 and longer[6]["loss"] == want[6]["loss"]  # not decayed yet
    # a checkpoint of the run's own folder is refused: resume=auto already continues it
    with pytest.raises(ValueError, match=r"own folder, which resume=auto already continues"):
        train(_cfg(long, *wsd, "total_tokens=4096", f"branch_from={step4}"))


def test_branch_from_edge_cases_name_the_branch(tmp_path, caplog) -> None:
    """What helper-73 found: refusals of a branch suggested resume=never or resume=<path>
    (both refused with branch_from) or moving the other run's checkpoint away; a reused branch
    folder ignored another branch_from with an INFO line; an incomplete checkpoint left a run
    folder behind; Ctrl-C before the branch's first checkpoint said a rerun starts over."""
    from fot.training.checkpoint import CorruptCheckpointError, interrupted_message

    parent = tmp_path / "parent"
    train(_cfg(parent, "total_tokens=1024", "keep_last=4"))  # checkpoints at steps 2 and 4
    step2, step4 = (parent / "checkpoints" / f"step_0000000{k}" for k in (2, 4))
    # another model: the ways out name branch_from, not resume=never
    other = tmp_path / "other"
    with pytest.raises(ValueError, match=r"A branch needs the checkpoint's values: .* \(branch_"):
        train(_cfg(other, "++model.overrides={hidden_size:64}", f"branch_from={step2}"))
    # past total_tokens: an earlier checkpoint to branch from, not to resume from
    with pytest.raises(ValueError, match=r"branch from an earlier checkpoint \(branch_from="):
        train(_cfg(other, "total_tokens=256", f"branch_from={step4}"))
    # an incomplete checkpoint: refused before the run folder is made
    broken = tmp_path / "broken" / "checkpoints" / "step_00000002"
    shutil.copytree(step2, broken)
    (broken / "optim.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"is incomplete: it has no optim.pt; branch"):
        train(_cfg(other, f"branch_from={broken}"))
    assert not other.exists()
    # a corrupt one: the other run's checkpoint is not to be moved away
    (broken / "optim.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CorruptCheckpointError) as corrupt:
        train(_cfg(other, f"branch_from={broken}"))
    assert str(corrupt.value).startswith(f"branch_from: checkpoint {broken} is corrupt")
    assert "That run has no other readable checkpoint" in str(corrupt.value)
    assert "resume=auto" not in str(corrupt.value)
    # the same for its trainer.json, which is read first (it said resume=never); the way out
    # names a readable checkpoint of that run, not a broken one
    shutil.copytree(step4, broken.parent / "step_00000004")
    shutil.copytree(step4, broken.parent / "step_00000006")
    (broken.parent / "step_00000006" / "trainer.json").write_text("{not json")
    (broken / "trainer.json").write_text('{"step": 2, "tok')
    with pytest.raises(CorruptCheckpointError) as corrupt:
        train(_cfg(other, f"branch_from={broken}"))
    assert str(corrupt.value).startswith(f"branch_from: checkpoint {broken} is corrupt")
    assert "cannot read trainer.json" in str(corrupt.value)
    assert str(corrupt.value).endswith(
        f"e.g. branch_from={broken.parent / 'step_00000004'} (its readable ones: step_00000004)"
    )
    assert "resume=" not in str(corrupt.value)
    # Ctrl-C before the branch's first checkpoint: a rerun starts from branch_from again
    assert interrupted_message(tmp_path / "none", "auto", str(step2)).endswith(
        f"a rerun starts from branch_from={step2} (ckpt_every_tokens sets how often "
        "checkpoints are written)"
    )
    # a branch from the parent's last step trains nothing: the warning names branch_from
    caplog.set_level(logging.INFO, logger="fot.train")
    last = tmp_path / "last"
    train(_cfg(last, "total_tokens=1024", f"branch_from={step4}"))
    assert f"branch_from={step4} is its run's last step (step 4;" in caplog.text
    # a finished branch's folder given another branch_from: a warning, not an INFO line
    branch = tmp_path / "branch"
    train(_cfg(branch, "total_tokens=1536", f"branch_from={step2}"))
    caplog.clear()
    train(_cfg(branch, "total_tokens=1536", f"branch_from={step2}"))  # the same command
    (same,) = [r for r in caplog.records if "is not read" in r.getMessage()]
    assert same.levelno == logging.INFO
    caplog.clear()
    train(_cfg(branch, "total_tokens=1536", f"branch_from={step4}"))
    (other_branch,) = [r for r in caplog.records if "is not read" in r.getMessage()]
    assert other_branch.levelno == logging.WARNING
    assert f"did not start from branch_from (its branch_from={step2})" in other_branch.getMessage()
    assert "to start over, pass another out_dir" in caplog.text  # not resume=never


def decay_names(model, group) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def _muon_cfg(**fields):
    from fot.training.config import OptimConfig

    base = dict(name="muon", lr=0.02, weight_decay=0.1, momentum=0.95, ns_steps=5)
    return OptimConfig(**{**base, "adjust_lr": "match_rms_adamw", **fields})


def test_muon_takes_the_projection_matrices_and_adamw_the_rest() -> None:
    from fot import presets
    from fot.training.optim import Muon, build_optimizer, muon_parameter_names

    model = presets.build_model(presets.config("fot_pro", "tiny", num_hidden_layers=1))
    opt = build_optimizer(model, _muon_cfg(), device=torch.device("cpu"))
    muon, adamw = opt.optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.process_group is None  # not under DDP: nothing to split
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    layer = "model.layers.0."
    assert in_muon == {  # by hand: the attention and MLP projections, nothing else
        layer + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o", "g")
    } | {layer + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_adamw == set(names.values()) - in_muon  # every other parameter, once
    assert layer + "self_attn.fgate_proj.weight" in in_adamw  # one row per head
    assert layer + "self_attn.q_norm.weight" in in_adamw  # 2-D, but a norm
    # 32 heads: the one-row-per-head projections are 32 x hidden, and still AdamW's
    wide = presets.build_model(
        presets.config("fot_pro", "tiny", num_hidden_layers=1, hidden_size=2048, num_heads=32)
    )
    per_head = {layer + f"self_attn.{x}_proj.weight" for x in ("fgate", "k_shift", "v_shift")}
    assert per_head.isdisjoint(muon_parameter_names(wide)) and len(muon_parameter_names(wide)) == 8
    lone = torch.nn.Sequential()
    lone.add_module("layers", torch.nn.ModuleList([torch.nn.Linear(4, 1)]))
    with pytest.raises(ValueError, match=r"found no projection matrix for Muon.*use optim=adamw"):
        muon_parameter_names(lone)
    (g,) = muon.param_groups
    assert (g["momentum"], g["nesterov"], g["ns_steps"]) == (0.95, True, 5)
    assert (g["weight_decay"], g["adjust_lr_fn"]) == (0.1, "match_rms_adamw")
    # the schedule sets every group's learning rate, Muon's included
    from fot.training.optim import set_lr

    set_lr(opt, 0.5)
    assert {g["lr"] for g in muon.param_groups + adamw.param_groups} == {0.5}


@pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="the oracle, torch.optim.Muon, needs torch >= 2.9"
)
def test_muon_steps_as_torch_optim_muon_bit_for_bit() -> None:
    """fot's Muon in one process against torch.optim.Muon: the same weights and momentum, bit
    for bit, after four steps, for tall and wide matrices, with and without Nesterov, both LR
    rules and torch's defaults (no adjust_lr_fn); the same state_dict keys, so that
    checkpoints of one load into the other."""
    from fot.training.optim import Muon

    torch.manual_seed(0)
    mats = [torch.randn(9, 4), torch.randn(4, 9), torch.randn(6, 6)]
    ours = [torch.nn.Parameter(m.clone()) for m in mats]
    theirs = [torch.nn.Parameter(m.clone()) for m in mats]

    def groups(params):
        return [
            {"params": params[:1], "adjust_lr_fn": "match_rms_adamw"},
            {"params": params[1:2], "nesterov": False, "momentum": 0.9, "weight_decay": 0.0},
            {"params": params[2:], "adjust_lr_fn": "original", "ns_steps": 3},
        ]

    opt, oracle = Muon(groups(ours), lr=0.03), torch.optim.Muon(groups(theirs), lr=0.03)
    for _ in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        opt.step()
        oracle.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["momentum_buffer"], oracle.state[b]["momentum_buffer"])
    mine, torchs = opt.state_dict(), oracle.state_dict()
    assert [sorted(g) for g in mine["param_groups"]] == [sorted(g) for g in torchs["param_groups"]]
    assert mine["state"].keys() == torchs["state"].keys()
    with pytest.raises(ValueError, match=r"Muon takes real 2-D parameters only, got one of \(3,\)"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    # torch.optim.Muon refuses each of these, when built or at its first step
    one = [torch.nn.Parameter(torch.zeros(2, 2))]
    for kwargs, message in (
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"momentum": -0.5}, "momentum must be >= 0"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
        ({"adjust_lr_fn": "foo"}, "adjust_lr_fn='foo' is not one of"),
        ({"ns_steps": 100}, "1 to 99 ns_steps"),
        ({"ns_coefficients": (1.0, 2.0)}, "3 ns_coefficients"),
        ({"lr": torch.tensor([0.1, 0.2])}, "1-element tensor"),
    ):
        with pytest.raises(ValueError, match=message):
            Muon(one, **kwargs)


def test_muon_runs_on_a_torch_without_torch_optim_muon(tmp_path) -> None:
    """optim=muon does not need torch.optim.Muon (torch >= 2.9): with it removed, as on torch
    2.8, the trainer imports and a Muon step runs (it broke every run, AdamW's too, when fot's
    Muon subclassed torch's)."""
    script = (
        "import torch\n"
        "del torch.optim.Muon\n"
        "import fot.training.trainer\n"
        "from fot.training.optim import Muon\n"
        "p = torch.nn.Parameter(torch.ones(3, 2)); p.grad = torch.ones(3, 2)\n"
        "Muon([p], lr=0.1).step()\n"
        "assert not torch.equal(p, torch.ones(3, 2))\n"
        "print('stepped')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "stepped" in proc.stdout, proc.stderr[-3000:]


def test_muon_step_is_the_orthogonalised_update_by_hand() -> None:
    """One MuonAdamW step against a float64 Newton-Schulz written here: the first step's
    Nesterov update is a multiple of the gradient, orthogonalised by the quintic iteration,
    scaled by 0.2 · sqrt(max(rows, cols)) (match_rms_adamw), after decoupled weight decay."""
    from fot.training.optim import MuonAdamW, build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("layers", torch.nn.ModuleList([torch.nn.Linear(48, 96, bias=True)]))
    w0, b0 = (t.detach().clone() for t in (model.layers[0].weight, model.layers[0].bias))
    grad = torch.randn(96, 48)
    model.layers[0].weight.grad, model.layers[0].bias.grad = grad.clone(), torch.ones(96)
    opt = build_optimizer(model, _muon_cfg(), device=torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    opt.step()

    x = grad.double().T  # the iteration runs on the wide orientation
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.775 * a + 2.0315 * a @ a) @ x
    update = x.T.float()
    want = w0 * (1 - 0.02 * 0.1) - 0.02 * 0.2 * 96**0.5 * update
    got = model.layers[0].weight.detach()
    step = (want - w0).abs().max()
    assert (got - want).abs().max() < 0.02 * step  # Muon iterates in bf16
    assert (got - w0).abs().max() > 0.5 * step  # it moved by the Muon step, not AdamW's lr
    # the bias went to AdamW (no decay): its first step moves each entry by lr
    assert torch.allclose(model.layers[0].bias.detach(), b0 - 0.02, atol=1e-6)
    opt.zero_grad()
    assert model.layers[0].weight.grad is None and model.layers[0].bias.grad is None


def test_muon_under_ddp_shares_the_orthogonalisations_over_ddps_ranks() -> None:
    """Under DDP the Muon of optim=muon gets DDP's process group, over which each rank
    orthogonalises its share of the matrices (without it every rank would do them all)."""
    import torch.distributed as dist

    from fot.training.optim import build_optimizer
    from fot.training.parallel import wrap_ddp

    model = torch.nn.Sequential()
    model.add_module("layers", torch.nn.ModuleList([torch.nn.Linear(8, 12, bias=False)]))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = wrap_ddp(model, torch.device("cpu"))
        muon, _ = build_optimizer(ddp, _muon_cfg(), device=torch.device("cpu")).optimizers
        assert muon.process_group is ddp.process_group
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="the oracle, torch.optim.Muon, needs torch >= 2.9"
)
def test_build_optimizer_gives_muon_the_configs_momentum_ns_steps_and_lr_rule() -> None:
    """optim.momentum, optim.ns_steps and optim.adjust_lr other than Muon's defaults reach the
    Muon that build_optimizer makes: three steps on a tall matrix end where
    torch.optim.Muon built with those values ends (bit for bit; the momentum shows from the
    second step on, the first update being the normalised gradient whatever it is)."""
    from fot.training.optim import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("layers", torch.nn.ModuleList([torch.nn.Linear(8, 20, bias=False)]))
    weight = model.layers[0].weight
    theirs = torch.nn.Parameter(weight.detach().clone())
    cfg = _muon_cfg(momentum=0.5, ns_steps=2, adjust_lr="original", weight_decay=0.05)
    opt = build_optimizer(model, cfg, device=torch.device("cpu"))
    oracle = torch.optim.Muon(
        [theirs], lr=0.02, weight_decay=0.05, momentum=0.5, nesterov=True, ns_steps=2,
        adjust_lr_fn="original",
    )  # fmt: skip
    for _ in range(3):
        weight.grad = torch.randn(weight.shape)
        theirs.grad = weight.grad.clone()
        opt.step()
        oracle.step()
    assert torch.equal(weight.detach(), theirs.detach())


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory) -> dict[int, float]:
    """An uninterrupted 8-step optim=muon run (parallel=single): its per-step losses."""
    out = tmp_path_factory.mktemp("muon")
    train(_cfg(out, "optim=muon", "optim.lr=0.01"))
    return _losses(out)


def test_muon_run_resumes_exactly_and_refuses_another_optimizer(
    tmp_path, reference_run, muon_run
) -> None:
    """optim=muon checkpoints both optimizers' state: a run stopped by SIGTERM and resumed
    logs the uninterrupted run's losses. Resuming it with optim=adamw is refused."""
    assert muon_run[1] == reference_run[1] and muon_run[8] != reference_run[8]  # Muon did step
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped), pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "sigterm_after_step:5")
        train(_cfg(out, "optim=muon", "optim.lr=0.01"))
    with pytest.raises(ValueError, match=r"optim.name=muon \(checkpoint\) vs adamw \(this run\)"):
        train(_cfg(out))
    train(_cfg(out, "optim=muon", "optim.lr=0.01"))
    assert _losses(out) == muon_run  # exact float equality, every step


@pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="the oracle, torch.optim.Muon, needs torch >= 2.9"
)
def test_muon_steps_fsdp_shards_as_torch_steps_whole_matrices(tmp_path) -> None:
    """fot's Muon on FSDP2's sharded parameters (two CPU processes, gloo; rows that do not
    split evenly, a rank without rows or matrices of its own) equals torch.optim.Muon on the whole matrices, bit for bit, in weights and
    momentum, after three steps with weight decay and both LR rules; so does it on replicated
    parameters (DDP), each rank orthogonalising its share. Sharded and plain parameters in one
    Muon are refused."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "muon_shards.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["local_rows"] for r in ranks] == [[4, 3, 6, 1], [3, 2, 6, 0]]  # really sharded
    assert "got 1 plain tensors among FSDP2's sharded parameters" in ranks[0]["mixed_refused"]
    for res in ranks:
        for key in ("", "_momentum"):
            pairs = zip(res[f"sharded{key}"], res[f"whole{key}"], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), key
            pairs = zip(res[f"replicated{key}"], res[f"whole{key}"][:3], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), key
        pairs = zip(res["bf16_replicated"], res["bf16_whole"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    # replicated (DDP): the 12 x 5 matrix (the costliest) on rank 0, the other two on rank 1
    assert ranks[0]["orthogonalised"] == [(12, 5)] * 3
    assert ranks[1]["orthogonalised"] == [(7, 5), (5, 7)] * 3


def test_muon_under_fsdp_trains_and_resumes_as_single(tmp_path, muon_run) -> None:
    """optim=muon with parallel=fsdp (a process group of one: DTensor parameters) logs the
    single-process run's losses; stopped by SIGTERM, its checkpoint (DTensor momentum buffers)
    resumes under parallel=single to the same losses."""
    import torch.distributed as dist

    out = tmp_path / "fsdp"
    try:
        with pytest.raises(TrainingStopped), pytest.MonkeyPatch.context() as mp:
            mp.setenv(FAULT_ENV, "sigterm_after_step:5")
            train(_cfg(out, "optim=muon", "optim.lr=0.01", "parallel=fsdp"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    fsdp_losses = _losses(out)
    assert 5 <= max(fsdp_losses) < 8 and sorted(fsdp_losses) == list(range(1, max(fsdp_losses) + 1))
    train(_cfg(out, "optim=muon", "optim.lr=0.01", "parallel=single"))
    got = _losses(out)
    assert got.keys() == muon_run.keys()
    for step, loss in muon_run.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), (step, got, muon_run)
        if step in fsdp_losses:
            assert fsdp_losses[step] == pytest.approx(loss, abs=1e-5), step


def test_no_weight_decay_on_biases_norms_and_gate_biases() -> None:
    from fot import presets

    model = presets.build_model(presets.config("fot_pro", "tiny", hidden_size=32, num_heads=2))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in no_decay["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in ids}
    for n, p in model.named_parameters():
        if p.ndim < 2 or "norm" in n or "bias" in n:
            assert n in names, n
        else:
            assert n not in names, n
    assert any(n.endswith("fgate_proj.bias") for n in names)  # the forget-gate bias
    assert any(n.endswith("fgate_proj.weight") for n in decay_names(model, decay))


def test_no_weight_decay_nor_muon_for_what_fla_marks_no_weight_decay() -> None:
    """Samba's Mamba layers hold ``A_log``, a (channels, state) matrix of log decay rates that
    FLA marks ``_no_weight_decay`` (the paper's code honours the mark): fot decayed it as a
    projection, and optim=muon orthogonalised its updates. The oracle, by hand: one AdamW step
    on zero gradients moves a parameter by its decoupled weight decay only, p(1 - lr·wd), so
    ``A_log`` and ``D`` stay as they were and ``in_proj`` shrinks; also under FSDP2, whose
    sharded parameters do not keep the mark's attribute. HGRN2's lower bounds, which the
    paper's code marks (FLA's does not), likewise."""
    import torch.distributed as dist

    from fot import presets
    from fot.training.config import OptimConfig, ParallelConfig
    from fot.training.optim import build_optimizer, muon_parameter_names
    from fot.training.parallel import DistInfo, parallelize

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    config = presets.config("samba", "tiny", attn=None, num_hidden_layers=1)  # no flash-attn

    def whole(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()

    try:
        for strategy in ("single", "fsdp"):
            torch.manual_seed(0)
            model = parallelize(
                presets.build_model(config),
                ParallelConfig(strategy=strategy),
                info,
                strategy=strategy,
            )
            opt = build_optimizer(
                model, OptimConfig(lr=0.5, weight_decay=0.1), device=torch.device("cpu")
            )
            before = {n: whole(p) for n, p in model.named_parameters()}
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.step()
            after = {n: whole(p) for n, p in model.named_parameters()}
            mixer = "backbone.layers.0.mixer."
            for name in (mixer + "A_log", mixer + "D"):
                assert torch.equal(after[name], before[name]), (strategy, name)
            assert before[mixer + "A_log"].ndim == 2  # a matrix, not caught as a vector
            shrunk = before[mixer + "in_proj.weight"] * (1 - 0.5 * 0.1)
            assert torch.allclose(after[mixer + "in_proj.weight"], shrunk, rtol=1e-6, atol=0)
            muon = muon_parameter_names(model)
            assert mixer + "in_proj.weight" in muon and mixer + "A_log" not in muon, strategy
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # HGRN2's lower bounds on its forget gates: the paper's code marks them, FLA does not
    model = presets.build_model(presets.config("hgrn2", "tiny"))
    opt = build_optimizer(model, OptimConfig(lr=0.5, weight_decay=0.1), device=torch.device("cpu"))
    bounds, q_proj = model.model.lower_bounds, model.model.layers[0].attn.q_proj.weight
    with torch.no_grad():
        bounds.add_(torch.randn_like(bounds))  # not the zeros that decay would keep
    before = [t.detach().clone() for t in (bounds, q_proj)]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(bounds.detach(), before[0])
    assert torch.allclose(q_proj.detach(), before[1] * (1 - 0.5 * 0.1), rtol=1e-6, atol=0)


def test_fsdp_in_one_process_equals_single(tmp_path, one_process_run) -> None:
    """parallel=fsdp without torchrun (a process group of one, made by ``parallelize``) trains
    to the same losses as parallel=single in fp32 on CPU."""
    import torch.distributed as dist

    single_dir, res1 = one_process_run
    fsdp_dir = tmp_path / "fsdp1"
    try:
        res2 = train(_cfg(fsdp_dir, *_COMMON, "parallel=fsdp"))
    finally:
        if dist.is_initialized():  # leave no process group behind for other tests
            dist.destroy_process_group()
    one, two = _losses(single_dir), _losses(fsdp_dir)
    assert one.keys() == two.keys() and len(one) > 0
    assert max(abs(one[k] - two[k]) for k in one) < 1e-5
    assert abs(res1["loss"] - res2["loss"]) < 1e-5


def test_fsdp_param_precision_fp32_keeps_the_residual_stream_fp32_as_single(
    tmp_path, caplog
) -> None:
    """Under bf16, FSDP2's bf16 parameters ran every block in bf16, its inputs cast to bf16
    (the residual stream between blocks too), where ``single``/``ddp`` and the paper's runs
    (fp32 weights under autocast) keep it fp32. ``parallel.param_precision=fp32`` gives FSDP2
    fp32 parameters under autocast: the residual reaching each block is fp32 and the losses are
    ``single``'s (the oracle: the same run with parallel=single)."""
    import torch.distributed as dist

    from fot import presets
    from fot.training.config import ParallelConfig
    from fot.training.parallel import DistInfo, parallelize

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    seen: dict[str, set] = {}
    try:
        for params in ("bf16", "fp32"):
            torch.manual_seed(0)
            config = presets.config("fot_pro", "tiny", hidden_size=32, num_heads=2)
            cfg = ParallelConfig(strategy="fsdp", precision="bf16", param_precision=params)
            model = parallelize(presets.build_model(config), cfg, info, strategy="fsdp")
            dtypes = seen.setdefault(params, set())
            for layer in model.model.layers[1:]:  # (hidden_states, residual, ctx)
                layer.register_forward_pre_hook(lambda _m, args, d=dtypes: d.add(args[1].dtype))
            ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=params == "fp32"):
                model(input_ids=ids, shift_labels=ids)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == {"bf16": {torch.bfloat16}, "fp32": {torch.float32}}
    bf16 = ["parallel.precision=bf16", "data.val_tokens=0", "total_tokens=1024"]
    train(_cfg(tmp_path / "single", *bf16))
    try:
        train(_cfg(tmp_path / "fsdp", *bf16, "parallel=fsdp", "parallel.param_precision=fp32"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    one, two = _losses(tmp_path / "single"), _losses(tmp_path / "fsdp")
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    assert max(abs(one[k] - two[k]) for k in one) < 1e-5, (one, two)
    # it sets FSDP2's parameters only: elsewhere it says so
    with caplog.at_level(logging.WARNING, logger="fot.train"):
        parallelize(
            presets.build_model(config),
            ParallelConfig(strategy="single", param_precision="fp32"),
            info,
            strategy="single",
        )
    assert "parallel.param_precision=fp32 has no effect with parallel=single" in caplog.text
    with pytest.raises(ValueError, match=r"parallel\.param_precision='fp16' is not one of"):
        train(_cfg(tmp_path / "bad", "parallel=fsdp", "parallel.param_precision=fp16"))


def test_fsdp_bf16_gradient_reduction(caplog) -> None:
    """``parallel.reduce_precision=bf16`` makes FSDP2 reduce gradients in bf16: every reduced
    gradient is a bf16 value, while an fp32 reduction leaves them off the bf16 grid (process
    group of one, fp32 model); an unknown value, or bf16 with DDP, is named; in a single
    process it has no effect, and says so."""
    import torch.distributed as dist

    from fot import presets
    from fot.training.config import ParallelConfig
    from fot.training.parallel import DistInfo, parallelize

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            config = presets.config("fot_pro", "tiny", hidden_size=32, num_heads=2)
            cfg = ParallelConfig(strategy="fsdp", precision="fp32", reduce_precision=precision)
            model = parallelize(presets.build_model(config), cfg, info, strategy="fsdp")
            ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
            model(input_ids=ids, shift_labels=ids).loss.backward()
            grads = [getattr(p.grad, "_local_tensor", p.grad) for p in model.parameters()]
            on_grid = [torch.equal(g, g.bfloat16().float()) for g in grads if g is not None]
            assert len(on_grid) > 10
            assert all(on_grid) if precision == "bf16" else not any(on_grid), on_grid
        bad = ParallelConfig(strategy="fsdp", reduce_precision="fp16")
        with pytest.raises(ValueError, match="reduce_precision='fp16' is not one of"):
            parallelize(presets.build_model(config), bad, info, strategy="fsdp")
        ddp = ParallelConfig(strategy="ddp", reduce_precision="bf16")
        with pytest.raises(ValueError, match="reduce_precision=bf16 needs parallel=fsdp"):
            parallelize(presets.build_model(config), ddp, info, strategy="ddp")
    finally:
        dist.destroy_process_group()
    # one process reduces nothing: bf16 was ignored without a word (and fp16 not refused)
    single = ParallelConfig(strategy="single", reduce_precision="bf16")
    with caplog.at_level(logging.WARNING, logger="fot.train"):
        parallelize(presets.build_model(config), single, info, strategy="single")
    assert "parallel.reduce_precision=bf16 has no effect in a single process" in caplog.text
    # FSDP2's reshard settings were ignored without a word outside parallel=fsdp
    caplog.clear()
    reshard = ParallelConfig(strategy="single", reshard_after_backward=True)
    with caplog.at_level(logging.WARNING, logger="fot.train"):
        parallelize(presets.build_model(config), reshard, info, strategy="single")
    assert "parallel.reshard_after_backward=true: no effect with parallel=single" in caplog.text
    with pytest.raises(ValueError, match="reduce_precision='fp16' is not one of"):
        parallelize(presets.build_model(config), bad, info, strategy="single")


@pytest.mark.parametrize("reshard_after_backward", [False, True])
def test_fsdp_accumulation_keeps_parameters_gathered(reshard_after_backward: bool) -> None:
    """Gradient accumulation under FSDP2 (process group of one, fp32): with
    ``reshard_after_backward=false`` the parameters stay gathered (plain tensors, not DTensor
    shards) between a step's micro batches and are sharded again after the last one; with
    ``true`` they are sharded after every micro batch. Only the last micro batch reduces:
    the sharded parameters have no gradient before it. Every block is an FSDP unit of its own
    (gathered one at a time), besides the root. Either way the accumulated gradients equal
    those of the unsharded model over the same two micro batches."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from fot import presets
    from fot.training.config import ParallelConfig
    from fot.training.parallel import DistInfo, accumulation, parallelize

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    config = presets.config("fot_pro", "tiny", hidden_size=32, num_heads=2)
    torch.manual_seed(0)
    reference = presets.build_model(config)
    sharded = presets.build_model(config)
    sharded.load_state_dict(reference.state_dict())
    micro = [
        torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    ]
    for ids in micro:
        reference(input_ids=ids, shift_labels=ids).loss.backward()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = ParallelConfig(
            strategy="fsdp", precision="fp32", reshard_after_backward=reshard_after_backward
        )
        model = parallelize(sharded, cfg, info, strategy="fsdp")
        assert all(isinstance(block, FSDPModule) for block in model.model.layers)
        assert isinstance(model, FSDPModule)
        gathered, reduced = [], []
        for i, ids in enumerate(micro):
            with accumulation(model, "fsdp", last=i == len(micro) - 1, cfg=cfg):
                model(input_ids=ids, shift_labels=ids).loss.backward()
            gathered.append(not any(isinstance(p, DTensor) for p in model.parameters()))
            reduced.append(any(p.grad is not None for p in model.parameters()))
        assert gathered == [not reshard_after_backward, False]
        if reshard_after_backward:  # sharded after the first micro batch: no reduced gradient
            assert reduced == [False, True]
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()


def test_fsdp_in_one_process_saves_plain_tensors_exports_and_resumes(
    tmp_path, one_process_run
) -> None:
    """A process group of one still shards into DTensors: its checkpoint must hold plain full
    tensors equal to parallel=single's, the HF export must work, and the checkpoint must resume
    under parallel=single and parallel=fsdp to the same losses as single resumed from single."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    single_dir, _ = one_process_run
    fsdp_dir = tmp_path / "fsdp1"
    try:
        res = train(_cfg(fsdp_dir, *_COMMON, "parallel=fsdp", "export_hf=true"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert (fsdp_dir / "final.json").is_file()
    assert Path(res["hf_dir"]) == fsdp_dir / "hf"
    assert (fsdp_dir / "hf" / "config.json").is_file()
    assert list((fsdp_dir / "hf").glob("*.safetensors"))
    fsdp_ckpt = fsdp_dir / "checkpoints" / "step_00000004"
    single_ckpt = single_dir / "checkpoints" / "step_00000004"
    got = torch.load(fsdp_ckpt / "model.pt", weights_only=True)
    want = torch.load(single_ckpt / "model.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert type(v) is torch.Tensor, (k, type(v))
        assert torch.allclose(v, want[k], atol=1e-5, rtol=1e-4), k
    optim = torch.load(fsdp_ckpt / "optim.pt", weights_only=False)
    for name, st in optim["state"].items():
        for key, v in st.items():
            assert not isinstance(v, DTensor), (name, key)

    # oracle: the single run's checkpoint resumed under parallel=single
    oracle = tmp_path / "oracle"
    train(_cfg(oracle, *_COMMON, "total_tokens=2048", f"resume={single_ckpt}"))
    want_losses = _losses(oracle)
    assert sorted(want_losses) == [5, 6, 7, 8]
    for strategy in ("single", "fsdp"):
        out = tmp_path / f"resumed_{strategy}"
        try:
            train(
                _cfg(
                    out,
                    *_COMMON,
                    "total_tokens=2048",
                    f"resume={fsdp_ckpt}",
                    f"parallel={strategy}",
                )
            )
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        got_losses = _losses(out)
        assert got_losses.keys() == want_losses.keys(), strategy
        for k in want_losses:
            assert got_losses[k] == pytest.approx(want_losses[k], abs=1e-5), (strategy, k)


def test_corrupt_latest_checkpoint_is_named_and_resuming_earlier_abandons_it(
    tmp_path, reference_run
) -> None:
    from fot.training.checkpoint import CorruptCheckpointError, clean_stale, latest_checkpoint

    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=1024"))  # 4 steps; checkpoints at steps 2 and 4
    ckpts = out / "checkpoints"
    step2, step4 = ckpts / "step_00000002", ckpts / "step_00000004"
    assert list_checkpoints(ckpts) == [step2, step4]
    with open(step4 / "model.pt", "r+b") as f:
        f.truncate(1 << 20)
    with pytest.raises(CorruptCheckpointError) as err:
        train(_cfg(out, "total_tokens=2048"))  # resume=auto picks the corrupt step 4
    msg = str(err.value)
    assert str(step4) in msg and "model.pt" in msg
    assert f"resume={step2}" in msg and "step_00000002" in msg
    assert "delete or move" in msg
    assert (step4 / "model.pt").stat().st_size == 1 << 20  # nothing touched

    # follow the advice: resume from step 2 (inside the warmup, so the schedule is the same as
    # the 8-step reference run's); the stale step 4 is moved aside, not deleted
    train(_cfg(out, "total_tokens=2048", f"resume={step2}"))
    abandoned = ckpts / ".abandoned-step_00000004"
    assert (abandoned / "model.pt").stat().st_size == 1 << 20
    # keep_last=2 kept this run's newest, not the stale one
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000006", "step_00000008"]
    assert latest_checkpoint(ckpts) == ckpts / "step_00000008"
    assert _losses(out) == reference_run  # steps 3, 4 re-run; all exactly as uninterrupted
    # metrics.jsonl holds this run's records only, each step once; the abandoned run's
    # records of steps 3 and 4 were moved aside, not lost
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    loss_steps = [r["step"] for r in recs if "loss" in r]
    assert loss_steps == list(range(1, 9))
    aside = [json.loads(x) for x in (out / "metrics.abandoned.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in aside}) == [3, 4]
    # and so was the abandoned run's final.json (it named step 4 while this run trained)
    assert json.loads((out / "final.abandoned.json").read_text())["step"] == 4
    assert json.loads((out / "final.json").read_text())["step"] == 8
    clean_stale(ckpts)
    assert abandoned.is_dir()


def test_resume_never_moves_the_previous_runs_results_aside(tmp_path) -> None:
    """A finished run's final.json and hf/ stayed while a run started over in its folder: an
    interrupted new run showed the old results beside its own metrics."""
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=1024", "export_hf=true"))  # 4 steps
    old_weights = (out / "hf" / "model.safetensors").read_bytes()
    train(_cfg(out, "total_tokens=1024", "export_hf=true", "resume=never", "seed=1"))
    assert json.loads((out / "final.abandoned.json").read_text())["step"] == 4
    assert (out / "hf.abandoned" / "model.safetensors").read_bytes() == old_weights
    assert (out / "hf" / "model.safetensors").read_bytes() != old_weights  # this run's
    # a third start moves the second run's results to the next free names
    train(_cfg(out, "total_tokens=512", "resume=never"))
    assert (out / "final.abandoned.json.1").is_file() and (out / "hf.abandoned.1").is_dir()
    assert json.loads((out / "final.json").read_text())["step"] == 2


def test_abandon_newer_records_moves_later_steps_and_cut_lines_aside(tmp_path) -> None:
    from fot.training.metrics import abandon_newer_records

    path = tmp_path / "metrics.jsonl"
    assert abandon_newer_records(path, 0) == 0  # no file yet
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join([*lines, '{"step": 5, "lo']))  # cut short by a crash
    assert abandon_newer_records(path, 2) == 3
    assert path.read_text().splitlines() == lines[:2]
    aside = tmp_path / "metrics.abandoned.jsonl"
    assert aside.read_text().splitlines() == [*lines[2:], '{"step": 5, "lo']
    assert abandon_newer_records(path, 2) == 0
    assert abandon_newer_records(path, 0) == 2  # a new run in the same folder: all moved
    assert path.read_text() == "" and len(aside.read_text().splitlines()) == 5
    # a file that cannot be read stops the run with its name (it was taken for no records, or
    # stopped it with "'utf-8' codec can't decode byte 0xff"), and is left as it is
    path.write_bytes(b'{"step": 1}\n\xff\n')
    with pytest.raises(ValueError, match=f"^cannot read {path}: byte 12 is not UTF-8 text"):
        abandon_newer_records(path, 0)
    assert path.read_bytes() == b'{"step": 1}\n\xff\n'
    path.unlink()
    path.mkdir()
    with pytest.raises(ValueError, match=f"^cannot read {path}: Is a directory. It holds a run's"):
        abandon_newer_records(path, 0)


def test_a_delete_cut_short_by_keep_last_leaves_no_checkpoint_that_looks_complete(
    tmp_path, monkeypatch
) -> None:
    """keep_last deleted old checkpoints in place: a kill during the delete left a step_N folder
    with trainer.json but no model.pt, which counted as a complete checkpoint (for keep_last, and
    as the earlier one to resume from in the corrupt-checkpoint error)."""
    from fot.training import checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    state = {"step": 0, "tokens": 0, "data": {}, "sizes": {}}

    def save(step: int):
        return checkpoint.save_checkpoint(tmp_path, step=step, model=model, optimizer=opt,
                                          trainer_state=state, keep_last=1, is_main=True)  # fmt: skip

    save(1)
    rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):  # deletes one file of the old checkpoint, then dies
        if not (Path(path) / "model.pt").is_file():
            return rmtree(path, *args, **kwargs)
        (Path(path) / "model.pt").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save(2)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    assert list_checkpoints(tmp_path) == [tmp_path / "step_00000002"]
    checkpoint.clean_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
    save(2)  # saving a step again (the final save) replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


def test_a_final_export_cut_short_by_a_kill_is_removed_when_the_run_starts_again(
    tmp_path,
) -> None:
    """The final export is written into .hf.new-<pid> beside hf/ (inside an existing hf/) and
    moved in once complete; a run killed while writing it left that folder for good."""
    from fot.training.checkpoint import clean_stale

    ckpts = tmp_path / "checkpoints"
    for folder in ("checkpoints/step_00000002", "checkpoints/.tmp-step_00000004", "hf",
                   ".hf.new-4242", ".hf.new-17/sub", "hf/.hf.new-5", "notes.new-1"):  # fmt: skip
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "model.safetensors").write_bytes(b"x")
    clean_stale(ckpts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "hf", "notes.new-1"]
    assert [p.name for p in ckpts.iterdir()] == ["step_00000002"]
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["model.safetensors"]
    clean_stale(tmp_path / "no-checkpoints-yet")  # a run that has none: nothing to do


def test_abandon_newer_moves_only_newer_checkpoints_aside(tmp_path) -> None:
    from fot.training.checkpoint import abandon_newer, clean_stale, latest_checkpoint

    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (ckpts / f"step_{step:08d}").mkdir(parents=True)
        (ckpts / f"step_{step:08d}" / "trainer.json").write_text(json.dumps({"step": step}))
    (ckpts / ".abandoned-step_00000006").mkdir()  # left by an earlier abandoned run
    moved = abandon_newer(ckpts, 2, keep=ckpts / "step_00000002")
    assert [p.name for p in moved] == [".abandoned-step_00000004", ".abandoned-step_00000006.1"]
    assert all((p / "trainer.json").is_file() for p in moved)
    assert list_checkpoints(ckpts) == [ckpts / "step_00000002"]
    assert latest_checkpoint(ckpts) == ckpts / "step_00000002"
    clean_stale(ckpts)
    assert all(p.is_dir() for p in moved) and (ckpts / ".abandoned-step_00000006").is_dir()
    assert abandon_newer(ckpts, 2) == []


def _flat_source(num_sequences: int, seq_len: int = 64):
    from fot.data.streams import PackedSource

    tokens = np.arange(num_sequences * seq_len + 1) % 50000
    return PackedSource.from_flat(tokens.astype(np.uint16), seq_len, varlen=False)


def _data_cfg(kind: str, val_tokens: int, seq_len: int = 64):
    return OmegaConf.create({"kind": kind, "seq_len": seq_len, "val_tokens": val_tokens})


def test_validation_never_reads_past_the_held_out_data(caplog) -> None:
    from fot.training.trainer import validation_sequences

    caplog.set_level(logging.WARNING, logger="fot.train")
    held = _flat_source(10)
    assert held.num_sequences == 10
    # enough held-out data: val_tokens rounded up to whole sequences, no warning
    assert validation_sequences(_data_cfg("tokens", 64 * 5 - 10), held, unit=1, warn=True) == 5
    assert validation_sequences(_data_cfg("tokens", 64 * 4), held, unit=2, warn=True) == 4
    assert not caplog.records
    # ... then to the unit (processes x validation micro batch): another process count would
    # validate on other sequences, which was not said (val/loss 10.6467 with one process and
    # 10.6481 with two for data.val_tokens=256, micro batch 4, sequences of 64)
    assert validation_sequences(_data_cfg("tokens", 64 * 5), held, unit=2, warn=True) == 6
    assert "reads 6 sequences (384 tokens), more than data.val_tokens=320" in caplog.text
    caplog.clear()
    # 16 asked, 10 held: the largest multiple of the unit that fits, and why
    assert validation_sequences(_data_cfg("tokens", 64 * 16), held, unit=4, warn=True) == 8
    assert "reads 8 sequences" in caplog.text and "holds only 10" in caplog.text
    caplog.clear()
    # fewer sequences than one unit: one unit (wrapping), said out loud
    assert (
        validation_sequences(_data_cfg("tokens", 64 * 16), _flat_source(3), unit=4, warn=True) == 4
    )
    assert "counts some sequences twice" in caplog.text
    caplog.clear()
    assert validation_sequences(_data_cfg("tokens", 64 * 16), held, unit=4, warn=False) == 8
    assert not caplog.records


def test_validation_losses_are_token_means_over_the_positions_they_name() -> None:
    """evaluate()'s val/loss against cross entropy computed here from the model's logits:
    the mean over every label that counts (padded rows' -100 left out), and
    val/loss_last_<k> the mean over the last k positions of each sequence only. Documents of
    other lengths than the rows put a different number of counted labels in each window, so
    a mean over the wrong positions or over padding gives another number."""
    from fot import presets
    from fot.data.streams import PaddedSource
    from fot.training.parallel import DistInfo
    from fot.training.trainer import evaluate

    torch.manual_seed(0)
    model = presets.build_model(
        presets.config("fot_pro", "tiny", hidden_size=32, num_hidden_layers=1, num_heads=2)
    )
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, n) for n in (1500, 300, 700)]  # rows of 1024: cut, padded
    source = PaddedSource(docs, 1024)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    got = evaluate(model, source, num_sequences=3, micro_batch_size=2, info=info, amp_dtype=None)

    inputs, labels = (torch.from_numpy(a) for a in source.read(0, 3))
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    ce = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2).double(), labels, ignore_index=-100, reduction="none"
    )  # (3, 1024), 0 where ignored
    counted = labels != -100
    assert counted[:, -512:].sum() == 512 + 0 + 189  # the 300-token row ends before them
    want = {
        "val/loss": ce.sum() / counted.sum(),
        "val/loss_last_512": ce[:, -512:].sum() / counted[:, -512:].sum(),
        "val/loss_last_1024": ce.sum() / counted.sum(),
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(float(value), rel=1e-5), key
    # the windows differ by more than the tolerance (an untrained model: all near ln 50257)
    assert abs(got["val/loss_last_512"] - got["val/loss"]) > 1e-4 * got["val/loss"]


@pytest.mark.parametrize(
    ("kind", "fix"), [("tokens", "data.val_path="), ("hf", "data.hf_val_split=")]
)
def test_missing_held_out_data_is_said_with_the_fix(caplog, kind: str, fix: str) -> None:
    from fot.training.trainer import validation_sequences

    caplog.set_level(logging.WARNING, logger="fot.train")
    assert validation_sequences(_data_cfg(kind, 0), None, unit=1, warn=True) == 0
    assert not caplog.records  # validation switched off on purpose
    assert validation_sequences(_data_cfg(kind, 4096), None, unit=1, warn=True) == 0
    assert "no validation" in caplog.text and fix in caplog.text
    assert "data.val_tokens=0" in caplog.text
    if kind == "hf":
        # the split slices it suggests, as written, are overrides that Hydra reads (unquoted,
        # train[:1%] is a syntax error)
        import re

        quoted = re.findall(r"'(data\.hf_(?:val_)?split=[^']+)'", caplog.text)
        assert len(quoted) == 2, caplog.text
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("train", overrides=["data=hf", *quoted])
        assert (cfg.data.hf_val_split, cfg.data.hf_split) == ("train[:1%]", "train[1%:]")


def test_config_warnings_wait_for_the_run_checks(tmp_path, caplog) -> None:
    """A warning about a value that runs (warmup longer than the run) is not printed above an
    unrelated error that refuses the run; once the run starts, it is."""
    long_warmup = "schedule.warmup_tokens=100000"
    missing = tmp_path / "no_such_tokens"
    with caplog.at_level(logging.WARNING), pytest.raises(FileNotFoundError):
        train(_cfg(tmp_path / "refused", long_warmup, "data=tokens", f"data.path={missing}"))
    assert "never reaches optim.lr" not in caplog.text
    with caplog.at_level(logging.WARNING):
        train(_cfg(tmp_path / "run", long_warmup, "total_tokens=256"))
    assert caplog.text.count("never reaches optim.lr") == 1


def test_bad_data_or_sizes_leave_no_run_folder(tmp_path) -> None:
    missing = tmp_path / "no_such_tokens"
    out = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match=r"fot\.data\.prepare"):
        train(_cfg(out, "data=tokens", f"data.path={missing}"))
    assert not out.exists()
    with pytest.raises(ValueError, match=r"cannot be split|multiple"):
        train(_cfg(out, "micro_batch_size=3"))
    assert not out.exists()
    with pytest.raises(ValueError, match=r"wandb\.mode='onlin' is not one of"):
        train(_cfg(out, "wandb.mode=onlin"))
    assert not out.exists()


def test_ddp_without_torchrun_leaves_no_run_folder(tmp_path) -> None:
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"needs torchrun.*parallel=single"):
        train(_cfg(out, "parallel=ddp"))
    assert not out.exists()


def test_torchrun_user_error_names_each_rank(tmp_path) -> None:
    """Under torchrun every rank prints its own one-line error; each says which rank it is
    (two identical unlabelled lines read as one error printed twice)."""
    run = tmp_path / "run"
    res = _run_script(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "train.py"), *SMALL, "parallel=ddp", "resume=/no/such/ckpt",
         f"out_dir={run}", f"hydra.run.dir={run}"],
        cwd=tmp_path,
        env_extra={"OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"},
    )  # fmt: skip
    assert res.returncode != 0
    # the first rank to fail makes torchrun stop the other, which may not get to print
    errors = [ln for ln in res.stderr.splitlines() if ": error: " in ln]
    assert errors, res.stderr[-3000:]
    for line in errors:
        assert re.fullmatch(
            r"train\.py \(rank [01] of 2\): error: resume=/no/such/ckpt does not exist; .*", line
        ), line
    for source in (ROOT / "train.py", ROOT / "fot"):  # no traceback from the ranks
        assert f'File "{source}' not in res.stderr  # (torchrun prints one of its own)


def test_train_py_refuses_a_shared_multirun_out_dir(tmp_path) -> None:
    """``-m`` with one fixed out_dir would make each later job resume from the previous job's
    checkpoint and train nothing: refused before any folder is made."""
    out = tmp_path / "sweep"
    script = [sys.executable, str(ROOT / "train.py")]
    res = _run_script([*script, "-m", *SMALL, "optim.lr=0.01,0.02", f"out_dir={out}"], cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith(f"train.py: error: out_dir={out} with -m")
    assert "hydra.sweep.dir=" in res.stderr
    assert not out.exists() and not (tmp_path / "multirun").exists()  # nor Hydra's sweep folder


@pytest.mark.parametrize(
    ("swept", "refused"),
    [
        # fgate_bias_init: fot_pro has a forget gate, transformer_llama none
        (["model=fot_pro,transformer_llama",
          "++model.overrides={hidden_size:32,num_hidden_layers:1,num_heads:2,fgate_bias_init:3.0}"],
         "job #1 of the sweep (model=transformer_llama) would be refused: model=transformer_llama "
         "size=tiny, model.overrides="),
        # 4 sequences per batch: micro_batch_size=3 does not split them
        (["micro_batch_size=2,3"],
         "job #1 of the sweep (micro_batch_size=3) would be refused: a global batch of 4 "
         "sequences"),
    ],
)  # fmt: skip
def test_a_sweep_value_refused_for_one_job_stops_the_sweep_before_any_job_trains(
    tmp_path, swept, refused
) -> None:
    """Hydra checks only that every job's config composes: a value that training refuses for
    one job (an override one swept model does not have, a micro batch that does not split)
    stopped the sweep when it reached that job, after the jobs before it had trained. Every
    job is now checked first, and nothing is made."""
    sweep = tmp_path / "sweep"
    res = _run_script(_sweep_args(sweep, *swept), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.startswith(f"train.py: error: {refused}"), res.stderr[-3000:]
    assert res.stderr.rstrip().endswith(
        "No job has started: change that value or leave it out of the sweep"
    )
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert not sweep.exists() and not (tmp_path / "multirun").exists()


def test_a_sweep_over_a_data_path_that_is_not_there_stops_before_any_job_trains(
    tmp_path,
) -> None:
    """A data.path swept over a file that does not exist was refused only when the sweep
    reached that job: job #0 trained first, and the refused job left its folder behind. The
    paths of every job are checked first (without reading data): one line names the job and
    the path, and nothing is made."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, (np.arange(20_000) % 50_000).astype(np.uint16))
    missing = tmp_path / "no_such_tokens.npy"
    sweep = tmp_path / "sweep"
    res = _run_script(
        [sys.executable, str(ROOT / "train.py"), "-m", *SMALL, "data=tokens",
         f"data.path={tokens},{missing}", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr == (
        f"train.py: error: job #1 of the sweep (data.path={missing}) would be refused: "
        f"data.path={missing} does not exist. Turn text files, folders or HF datasets into a "
        "token folder with `python -m fot.data.prepare --help`, then set data.path=<folder>. "
        "No job has started: change that value or leave it out of the sweep\n"
    )
    assert not sweep.exists() and not (tmp_path / "multirun").exists()


def test_sweep_jobs_whose_out_dir_is_one_folder_are_refused_before_any_job_trains(
    tmp_path,
) -> None:
    """out_dir=runs/${model.name} while sweeping the learning rate put both jobs in one
    folder: job #1 found job #0's finished run and did nothing ("nothing to do"), and the
    sweep exited 0 with one result for two learning rates. Each job's out_dir is resolved
    before the first trains; jobs that share one are named, and nothing is made."""
    sweep = tmp_path / "sweep"
    runs = tmp_path / "runs"
    res = _run_script(
        _sweep_args(sweep, "optim.lr=0.001,0.003", f"out_dir={runs}/${{model.name}}"),
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr == (
        "train.py: error: jobs #0 (optim.lr=0.001) and #1 (optim.lr=0.003) of the sweep would "
        f"both run in out_dir={runs / 'fot_pro'}: the later one would go on from the earlier "
        "one's run instead of training its own. No job has started: put a swept value in "
        "out_dir (e.g. out_dir=runs/${hydra:job.num}) or leave out_dir out (each job then gets "
        "its own folder)\n"
    )
    assert not sweep.exists() and not runs.exists() and not (tmp_path / "multirun").exists()


def test_a_sweep_job_refused_while_starting_leaves_no_folder_behind(tmp_path) -> None:
    """A job of a new sweep that training refused after Hydra had made its folder (data=hf
    with a data.path that is not there: a hub name is not checked before the sweep) left the
    folder behind with only train.log and the lock file in it, and the sweep folder with it
    when that was the first job. The refused job's folder is removed; the jobs that trained
    keep theirs (and the sweep folder its multirun.yaml); a sweep folder that already existed
    is left as it was (Hydra's multirun.yaml and the refused job's folder were left in it)."""
    text = tmp_path / "texts"  # a folder of text files
    text.mkdir()
    (text / "a.txt").write_text("A few plain words of English for the tokenizer to read. " * 400)
    missing = tmp_path / "no_such_text"
    script = [sys.executable, str(ROOT / "train.py"), "-m", *SMALL, "data=hf", "data.val_tokens=0",
              "total_tokens=512"]  # fmt: skip
    sweep = tmp_path / "sweep"
    res = _run_script(
        [*script, f"data.path={text},{missing}", f"hydra.sweep.dir={sweep}"], cwd=tmp_path
    )
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"train.py: error: data.path={missing}: {missing} does not exist." in res.stderr
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]
    assert (sweep / "0" / ".hydra" / "config.yaml").is_file()
    assert list((sweep / "0" / "checkpoints").iterdir())  # the job that trained is kept

    first_refused = tmp_path / "first_refused"
    res = _run_script(
        [*script, f"data.path={missing},{text}", f"hydra.sweep.dir={first_refused}"],
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "does not exist" in res.stderr, res.stderr[-3000:]
    assert not first_refused.exists()

    made = tmp_path / "made_before"
    made.mkdir()
    res = _run_script(
        [*script, f"data.path={missing},{text}", f"hydra.sweep.dir={made}"], cwd=tmp_path
    )
    assert res.returncode == 2 and "does not exist" in res.stderr, res.stderr[-3000:]
    assert list(made.iterdir()) == []  # as it was


def test_a_refused_job_leaves_a_folder_outside_the_sweep_as_it_found_it(tmp_path) -> None:
    """A sweep job with a folder of its own outside the sweep folder (out_dir=...job.num...)
    that training refused left its .run.lock there: the folders in the sweep folder were
    cleaned, that one was not. The lock file a refused run made is removed, in any folder;
    one an earlier run left, and every other file, stay."""
    text = tmp_path / "texts"
    text.mkdir()
    (text / "a.txt").write_text("A few plain words of English for the tokenizer to read. " * 400)
    missing = tmp_path / "no_such_text"
    runs = tmp_path / "runs"
    (runs / "job1").mkdir(parents=True)  # made before, e.g. by a script
    res = _run_script(
        [sys.executable, str(ROOT / "train.py"), "-m", *SMALL, "data=hf", "data.val_tokens=0",
         "total_tokens=512", f"data.path={text},{missing}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
         f"out_dir={runs}/job${{hydra:job.num}}"],
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2 and f"{missing} does not exist" in res.stderr, res.stderr[-3000:]
    assert list((runs / "job1").iterdir()) == []
    assert list((runs / "job0" / "checkpoints").iterdir())  # the job that trained is kept
    # the Python API: another file and an earlier run's lock file stay
    (runs / "job1" / "notes.txt").write_text("mine")
    refused = _cfg(runs / "job1", "data=hf", f"data.path={missing}", "data.val_tokens=0")
    with pytest.raises(ValueError, match="does not exist"):
        train(refused)
    assert [p.name for p in (runs / "job1").iterdir()] == ["notes.txt"]
    (runs / "job1" / ".run.lock").write_text("pid 1 on an earlier run\n")
    with pytest.raises(ValueError, match="does not exist"):
        train(refused)
    assert sorted(p.name for p in (runs / "job1").iterdir()) == [".run.lock", "notes.txt"]


def test_a_sweep_rerun_with_its_values_reordered_is_refused_before_a_job_continues(
    tmp_path,
) -> None:
    """Hydra numbers a sweep's jobs by their place in it: rerun in the same hydra.sweep.dir
    with the swept values in another order, job 0 got job 1's folder and continued its
    checkpoint under the other learning rate (a warning only). It is refused, naming both
    values, and the folders are left as they were; the same values written otherwise (2e-2
    for 0.02) in the first order are the same sweep."""
    sweep = tmp_path / "sweep"
    first = _run_script(_sweep_args(sweep, "total_tokens=512", "optim.lr=0.01,0.02"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    errors, _, _ = _refused_sweep_rerun(
        _sweep_args(sweep, "total_tokens=512", "optim.lr=2e-2,1e-2"), sweep, tmp_path
    )
    assert errors == [
        f"train.py: error: job 0 of this sweep has optim.lr=0.02, but its folder {sweep / '0'} "
        f"holds the checkpoints of a job with optim.lr=0.01 ({sweep / '0/.hydra/overrides.yaml'})"
        ": Hydra numbers a sweep's jobs by their place in it, and this rerun in "
        f"hydra.sweep.dir={sweep} lists the swept values in another order or others. To "
        "continue the sweep, list its values as before; for other values, pass a new "
        "hydra.sweep.dir (or leave it out)"
    ], errors
    same = _run_script(_sweep_args(sweep, "total_tokens=512", "optim.lr=1e-2,2e-2"), cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-3000:]
    # a finished job starts over in another sweep folder: -m refuses out_dir=...
    assert "the run already finished" in same.stdout
    assert "to start over, pass resume=never or another hydra.sweep.dir\n" in same.stdout


def test_a_sweep_rerun_that_sweeps_a_key_the_first_left_at_its_default_is_refused(
    tmp_path,
) -> None:
    """The rerun check compared only the keys that both sweeps set: a rerun in the same
    hydra.sweep.dir that also swept the seed, which the first sweep had left at its default
    (0), gave job 0 (now seed 1) the folder of the first sweep's job 0, which continued its
    checkpoint under the other seed (a warning only). The keys swept now are compared with
    the values that job ran with (its .hydra/config.yaml, and for a config group such as
    model its .hydra/hydra.yaml), and the rerun is refused."""
    from fot.provenance import sweep_job_conflict

    sweep = tmp_path / "sweep"
    first = _run_script(_sweep_args(sweep, "total_tokens=512", "optim.lr=0.01,0.02"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    errors, before, after = _refused_sweep_rerun(
        _sweep_args(sweep, "total_tokens=512", "seed=1,0", "optim.lr=0.01,0.02"),
        sweep,
        tmp_path,
    )
    assert errors == [
        f"train.py: error: job 0 of this sweep has seed=1, but its folder {sweep / '0'} holds "
        f"the checkpoints of a job with seed=0 (its default) ({sweep / '0/.hydra'}): Hydra "
        f"numbers a sweep's jobs by their place in it, and this rerun in hydra.sweep.dir={sweep} "
        "lists the swept values in another order or others. To continue the sweep, list its "
        "values as before; for other values, pass a new hydra.sweep.dir (or leave it out)"
    ], errors
    assert set(after) == set(before)  # no job folder was added

    # a config group swept now (model), left at its default (fot_pro) by the first sweep
    other = tmp_path / "other_sweep"
    other.mkdir()
    task = ["model=transformer_llama,fot_pro", "optim.lr=0.01,0.02"]
    (other / "multirun.yaml").write_text(
        OmegaConf.to_yaml({"hydra": {"overrides": {"task": task}}})
    )
    job = sweep / "0"
    for model, conflict in (("transformer_llama", True), ("fot_pro", False)):
        found = sweep_job_conflict(
            [*SMALL, f"model={model}", "optim.lr=0.01"], sweep=other, job=job, run=job
        )
        if conflict:
            assert found is not None and found.startswith(
                f"job 0 of this sweep has model=transformer_llama, but its folder {job} holds "
                f"the checkpoints of a job with model=fot_pro (its default) ({job / '.hydra'}): "
            ), found
        else:
            assert found is None, found


def test_a_sweep_rerun_that_leaves_at_its_default_a_key_the_first_swept_is_refused(
    tmp_path,
) -> None:
    """The mirror of the case above: a rerun in the same hydra.sweep.dir that no longer swept
    the seed, which the first sweep had swept (seed=1,0), gave job 0 (now seed 0, the default)
    the folder of the first sweep's seed=1 job, which it continued (a warning only): the
    rerun replaced multirun.yaml, so the seed was not compared. A key in which the earlier
    jobs' records differ is compared too, and the rerun is refused; a rerun in the same order
    that trains longer (total_tokens for every job) still goes on."""
    sweep = tmp_path / "sweep"
    first = _run_script(_sweep_args(sweep, "total_tokens=512", "seed=1,0"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    errors, _, _ = _refused_sweep_rerun(
        _sweep_args(sweep, "total_tokens=512", "optim.lr=0.01,0.02"), sweep, tmp_path
    )
    assert errors == [
        f"train.py: error: job 0 of this sweep has seed=0 (its default), but its folder "
        f"{sweep / '0'} holds the checkpoints of a job with seed=1 "
        f"({sweep / '0/.hydra/overrides.yaml'}): Hydra numbers a sweep's jobs by their place "
        f"in it, and this rerun in hydra.sweep.dir={sweep} lists the swept values in another "
        "order or others. To continue the sweep, list its values as before; for other values, "
        "pass a new hydra.sweep.dir (or leave it out)"
    ], errors
    longer = _run_script(_sweep_args(sweep, "seed=1,0", "total_tokens=768"), cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr[-3000:]
    for job in ("0", "1"):  # steps 1-2, then step 3 after the resume
        assert sorted(_losses(sweep / job)) == [1, 2, 3]


def test_train_py_refuses_a_missing_resume_folder_before_training(tmp_path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, "resume=/no/such/ckpt",
           f"out_dir={run}", f"hydra.run.dir={run}"]  # fmt: skip
    res = _run_script(cmd, cwd=tmp_path, env_extra={"HYDRA_FULL_ERROR": "0"})
    assert res.returncode == 2 and "resume=/no/such/ckpt does not exist" in res.stderr
    assert "Traceback" not in res.stderr and "HYDRA_FULL_ERROR=1" in res.stderr  # one message
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    full = _run_script(cmd, cwd=tmp_path, env_extra={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode != 0 and "Traceback" in full.stderr
    assert "resume=/no/such/ckpt does not exist" in full.stderr


def test_token_ids_outside_the_vocabulary_are_named_before_the_model_sees_them(tmp_path) -> None:
    ids = np.arange(64 * 40 + 1, dtype=np.int64) % 1000
    good = tmp_path / "good.npy"
    np.save(good, ids.astype(np.uint16))
    bad = ids.copy()
    bad[64 * 5 + 7] = 60000  # inside step 2's global batch (4 sequences of 64 per step)
    np.save(tmp_path / "bad.npy", bad.astype(np.uint16))
    flat = ["data=tokens", "data.packing=causal"]
    with pytest.raises(
        ValueError, match=r"training data of step 2 holds token id 60000.*50257"
    ) as err:
        train(_cfg(tmp_path / "a", *flat, f"data.path={tmp_path / 'bad.npy'}", "data.val_tokens=0"))
    # the first id outside, not the largest: the tokenizer's vocabulary, not 60001
    assert str(err.value).endswith(
        "or give the model the vocabulary of the tokenizer that made it (++model.overrides="
        "{vocab_size:<that tokenizer's vocabulary size>}, which is more than 60000; ids above "
        "60000 may follow)"
    )
    val_on = [*flat, f"data.path={good}", "data.val_tokens=1024", "val_every_tokens=0"]
    with pytest.raises(ValueError, match=r"held-out data holds token id 60000"):
        train(_cfg(tmp_path / "b", *val_on, f"data.val_path={tmp_path / 'bad.npy'}"))
    # the final checkpoint was saved before the final validation failed: no training is lost,
    # and with good held-out data the run finishes from it, validating once
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "checkpoints")][-1] == "step_00000008"
    result = train(_cfg(tmp_path / "b", *val_on, f"data.val_path={good}"))
    assert result["step"] == 8 and math.isfinite(result["val/loss"])
    recs = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "val/loss" in r] == [8]
    assert sorted(_losses(tmp_path / "b")) == list(range(1, 9))


def test_mfu_counts_the_attention_each_step_computes(tmp_path) -> None:
    """MFU counts the FLOPs of what was computed: with varlen packing attention stops at
    every document, so a step of short documents does less attention work than full causal
    sequences (the nominal ``flops_per_token``); with causal packing the two agree.
    Oracle: ``6 N`` per token plus ``12 L d`` per (query, key) pair, the pairs counted here
    from each row's EOT positions of the same data."""
    from fot.data.loaders import build_sources
    from fot.data.streams import EOT_ID, SequenceStream

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, 64 * 40 + 1)
    ids[np.cumsum(rng.integers(3, 30, 200))[:150]] = EOT_ID  # documents of 3-29 tokens
    np.save(tmp_path / "docs.npy", ids.astype(np.uint16))
    peak, L, d, T = 1e12, 1, 32, 64
    flat = ["data=tokens", f"data.path={tmp_path / 'docs.npy'}", "data.val_tokens=0",
            "total_tokens=768"]  # fmt: skip
    records = {}
    for packing in ("varlen", "causal"):
        cfg = _cfg(tmp_path / packing, *flat, f"data.packing={packing}", f"peak_flops={peak}")
        train(cfg)
        out = tmp_path / packing
        records[packing] = [
            json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
        ]
        info = json.loads((out / "run_info.json").read_text())[0]
        n = info["params_without_embedding"]
        assert info["flops_per_token"] == pytest.approx(6 * n + 12 * L * d * (T + 1) / 2)
        # the same data again, each logged step's FLOPs counted by hand
        train_source, _ = build_sources(cfg.data)
        stream = SequenceStream(train_source, global_batch_size=4, micro_batch_size=2)
        for rec in records[packing]:
            if "mfu" not in rec:
                continue
            flops = 0.0
            for b in stream.next_step():  # one step per record (log_every_tokens = one step)
                rows = b.input_ids.reshape(-1, T).numpy()
                for row in rows:
                    if packing == "causal":
                        lengths = [T]
                    else:
                        cuts = [0, *(i for i in np.flatnonzero(row == EOT_ID) if i > 0), T]
                        lengths = np.diff(cuts).tolist()
                    flops += 6 * n * T + 12 * L * d * sum(m * (m + 1) / 2 for m in lengths)
            dt = 256 / rec["tokens_per_s"]  # one step of 256 tokens per record
            assert rec["mfu"] == pytest.approx(flops / dt / peak, rel=1e-9), (packing, rec)
            nominal = info["flops_per_token"] * rec["tokens_per_s"] / peak
            if packing == "causal":
                assert rec["mfu"] == pytest.approx(nominal, rel=1e-9)
            else:
                assert rec["mfu"] < nominal  # documents of < 30 tokens in rows of 64
    assert len([r for r in records["varlen"] if "mfu" in r]) == 3


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        # NVIDIA's datasheets give bf16 tensor-core FLOP/s with sparsity; dense is half
        ("NVIDIA H100 80GB HBM3", 1979e12 / 2),
        ("NVIDIA H100 PCIe", 1513e12 / 2),
        ("NVIDIA H100 NVL", 1671e12 / 2),
        ("NVIDIA H800 PCIe", 1513e12 / 2),
        ("NVIDIA A100-SXM4-80GB", 624e12 / 2),
        ("NVIDIA H200", 1979e12 / 2),
        ("NVIDIA H200 NVL", 1671e12 / 2),
        ("NVIDIA B200", 4500e12 / 2),  # HGX B200: 36 PFLOP/s sparse over 8 GPUs
    ],
)
def test_peak_flops_of_the_card_the_name_says(monkeypatch, name: str, peak: float) -> None:
    """MFU's peak is the card's own: an H100 PCIe or NVL is no H100 SXM."""
    from fot.training.metrics import peak_flops_per_device

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops_per_device(torch.device("cuda", 0)) == pytest.approx(peak, rel=2e-3)


def test_mfu_of_a_float32_run_is_not_divided_by_a_bf16_peak(tmp_path, monkeypatch, caplog) -> None:
    """The known GPUs' peaks are bf16 ones: a run with ``parallel.precision=fp32`` on such a GPU
    logs no MFU (and says why) instead of dividing float32 FLOP/s by a bf16 peak; a bf16 run
    on the same (stand-in) GPU logs its MFU, ``peak_flops=`` gives a float32 run one. The GPU
    is a stand-in: the peak table answers 1e15 for the CPU."""
    import fot.training.trainer as trainer

    monkeypatch.setattr(trainer, "peak_flops_per_device", lambda device: 1e15)
    short = ["data.val_tokens=0", "total_tokens=512", "ckpt_every_tokens=0", "export_hf=false"]

    def mfus(name: str, *overrides: str) -> list:
        train(_cfg(tmp_path / name, *short, *overrides))
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r["mfu"] for r in map(json.loads, lines) if "tokens_per_s" in r]

    with caplog.at_level(logging.INFO, logger="fot.train"):
        fp32 = mfus("fp32", "parallel.precision=fp32")
    assert fp32 and all(m is None for m in fp32), fp32
    assert "MFU is not logged: parallel.precision=fp32" in caplog.text
    assert "set peak_flops=" in caplog.text
    bf16 = mfus("bf16", "parallel.precision=bf16")
    assert bf16 and all(m is not None and m > 0 for m in bf16), bf16
    given = mfus("given", "parallel.precision=fp32", "peak_flops=1e12")
    assert given and all(m is not None and m > 0 for m in given), given


def test_flop_counter_counts_sambas_sliding_window_attention_layers() -> None:
    """Samba's config names its softmax-attention layers (``attn.layers``, a sliding window of
    ``attn.window_size`` keys): each counts ``12 d`` FLOPs per (query, key) pair, the Mamba
    layers none. Recurrent models without such layers (DeltaNet) count no attention. The
    model is a stand-in (FLA's Samba needs flash-attn to build): only its parameter count
    matters here."""
    from fot import presets
    from fot.training.metrics import FlopCounter

    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(10, 4)  # not in N
    model.head = torch.nn.Linear(4, 7, bias=False)  # N = 28
    model.get_input_embeddings = lambda: model.emb
    samba = presets.config("samba", "tiny")  # hidden 128, attention in layer 1 of 2, window 64
    counter = FlopCounter.of(model, samba)
    assert (counter.params, counter.attn_layers, counter.d_attn, counter.window) == (28, 1, 128, 64)
    T = 256
    pairs = 64 * 65 // 2 + (T - 64) * 64  # the first 64 queries see 1..64 keys, the rest 64
    assert counter.of_documents([T]) == 6 * 28 * T + 12 * 1 * 128 * pairs
    deltanet = FlopCounter.of(model, presets.config("deltanet", "tiny"))
    assert deltanet.attn_layers == 0 and deltanet.of_documents([T]) == 6 * 28 * T


@pytest.mark.parametrize(("mode", "offers_offline"), [("online", True), ("offline", False)])
def test_wandb_that_cannot_start_warns_with_the_ways_out(
    tmp_path, monkeypatch, mode, offers_offline
):
    import wandb

    from fot.training.metrics import MetricsLogger

    def no_server(**kwargs):
        raise ConnectionError("no route to the wandb server")

    monkeypatch.setattr(wandb, "init", no_server)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the suite disables wandb
    cfg = OmegaConf.structured(WandbConfig(mode=mode, project="p"))
    with pytest.warns(UserWarning, match=r"no route.*wandb\.mode=disabled") as record:
        logger = MetricsLogger(tmp_path, enabled=True, wandb_cfg=cfg, config={})
    assert logger.wandb_run is None
    assert ("wandb.mode=offline" in str(record[0].message)) == offers_offline
    logger.log({"step": 1, "tokens": 8, "loss": 1.5})
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.5


def test_an_explicit_wandb_mode_wins_over_the_environment(tmp_path, monkeypatch) -> None:
    """WANDB_MODE (e.g. exported by a cluster profile) beat wandb.mode=offline/disabled given on
    the command line: a run marked offline could be uploaded, and the warning then advised the
    setting already given. The environment now decides only for wandb.mode=auto."""
    import wandb

    from fot.training.metrics import MetricsLogger, resolve_wandb_mode

    for env in ("online", "offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", env)
        for mode in ("online", "offline", "disabled"):
            assert resolve_wandb_mode(mode) == mode
        assert resolve_wandb_mode("auto") == env
    asked = {}

    def init(**kwargs):
        asked.update(kwargs)
        raise ConnectionError("the stand-in starts no run")

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = OmegaConf.structured(WandbConfig(mode="disabled", project="p"))
    MetricsLogger(tmp_path, enabled=True, wandb_cfg=cfg, config={}).close()
    assert asked == {}  # no wandb run at all
    cfg.mode = "offline"
    with pytest.warns(UserWarning, match=r"wandb \(offline\) did not start"):
        MetricsLogger(tmp_path, enabled=True, wandb_cfg=cfg, config={}).close()
    assert asked["mode"] == "offline"


def test_the_jobs_of_a_sweep_are_named_and_grouped_in_wandb(tmp_path, monkeypatch) -> None:
    """The jobs of `train.py -m ...` were wandb runs named 0, 1, 2, ... (their folders), in no
    group. They are named by their swept overrides and grouped by their sweep; a run of its own
    keeps its folder's name, and wandb.name / wandb.group win."""
    import wandb
    from hydra_sweeps import run_empty_sweep

    from fot.training.metrics import MetricsLogger

    asked = []

    def init(**kwargs):
        asked.append({k: kwargs[k] for k in ("name", "group")})
        raise ConnectionError("the stand-in starts no run")

    monkeypatch.setattr(wandb, "init", init)
    sweep = run_empty_sweep(tmp_path, "+model=fot_pro,fot_llama", "+total_tokens=64")
    (tmp_path / "own").mkdir()
    cfg = OmegaConf.structured(WandbConfig(mode="offline"))
    named = OmegaConf.structured(WandbConfig(mode="offline", name="n", group="g"))
    for out, wandb_cfg in [(sweep / "0", cfg), (sweep / "1", cfg), (tmp_path / "own", cfg),
                           (sweep / "1", named)]:  # fmt: skip
        with pytest.warns(UserWarning, match="did not start"):
            MetricsLogger(out, enabled=True, wandb_cfg=wandb_cfg, config={}).close()
    assert asked == [
        {"name": "model=fot_pro", "group": "s"},
        {"name": "model=fot_llama", "group": "s"},
        {"name": "own", "group": None},
        {"name": "n", "group": "g"},
    ]


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline wandb run, read from its ``.wandb`` transaction log:
    LevelDB log format (32 KiB blocks of records with a 7-byte header: CRC, length, type;
    a record cut at a block's end continues in the next), after wandb's own 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = run_dir.glob("*.wandb")
    data, block = log.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts, rows = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left for a header: zero padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:  # nothing more was written
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(parts)
            parts = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                        for i in rec.history.item
                    }
                )
    return rows


def test_wandb_keeps_the_steps_a_resumed_run_logs_again(tmp_path, monkeypatch):
    # After a resume, the steps after the checkpoint are logged a second time. Given as
    # wandb's step counter they were dropped ("steps must be monotonically increasing"); one
    # offline wandb run stands for the resumed online run, whose counter goes on likewise.
    from fot.training.metrics import MetricsLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the suite disables wandb
    cfg = OmegaConf.structured(WandbConfig(mode="offline", project="p"))
    logger = MetricsLogger(tmp_path, enabled=True, wandb_cfg=cfg, config={})
    assert logger.wandb_run is not None
    logged = [(s, float(s)) for s in (1, 2, 3, 4)] + [(s, 10.0 + s) for s in (3, 4, 5)]
    for step, loss in logged:
        logger.log({"step": step, "tokens": 8 * step, "loss": loss})
    logger.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    # wandb's service process may still be writing the log when finish() returns (seen once
    # in CI under load: no rows read, while wandb's own summary listed all seven)
    deadline = time.monotonic() + 30
    while len(rows := _wandb_history(run_dir)) < len(logged) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [r["loss"] for r in rows] == [loss for _, loss in logged]  # none dropped
    assert [(r["step"], r["loss"]) for r in rows] == logged
    assert [r["tokens"] for r in rows] == [8 * s for s, _ in logged]


def _fail_with_oom(monkeypatch, method: str, *, after_calls: int) -> None:
    """Make ``FoTForCausalLM.<method>`` raise torch's out-of-memory error from its
    ``after_calls + 1``-th call on (the error a too-large batch raises on a GPU)."""
    from fot.models.modeling_fot import FoTForCausalLM

    original = getattr(FoTForCausalLM, method)
    calls = {"n": 0}

    def patched(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after_calls:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 9.00 GiB. GPU 0 has a total capacity of "
                "79.19 GiB of which 1.20 GiB is free. If reserved but unallocated memory is large "
                "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            )
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FoTForCausalLM, method, patched)


def test_out_of_memory_in_a_step_names_the_settings_and_keeps_checkpoints(
    tmp_path, monkeypatch
) -> None:
    from fot.training import TrainingOutOfMemoryError
    from fot.training.checkpoint import load_checkpoint

    out = tmp_path / "run"
    # 2 micro batches per step: the 5th forward is step 3's first; step 2 wrote a checkpoint
    _fail_with_oom(monkeypatch, "forward", after_calls=4)
    with pytest.raises(TrainingOutOfMemoryError) as err:
        train(_cfg(out))
    msg = str(err.value)
    assert "training step 3: micro batches of 2 × 64 tokens (single)" in msg
    assert "(CUDA out of memory. Tried to allocate 9.00 GiB)" in msg  # torch's tips left out
    assert "total capacity" not in msg
    assert "lower micro_batch_size (now 2;" in msg
    assert "parallel.activation_checkpointing=true" in msg and "parallel=fsdp" in msg
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    (step2,) = list_checkpoints(out / "checkpoints")
    assert step2.name == "step_00000002"
    monkeypatch.undo()
    from fot import presets
    from fot.training.optim import build_optimizer
    from fot.training.trainer import model_config_from_train_config

    cfg = _cfg(out)
    model = presets.build_model(model_config_from_train_config(cfg))
    state = load_checkpoint(
        step2,
        model=model,
        optimizer=build_optimizer(model, cfg.optim, device=torch.device("cpu")),
        rank=0,
    )
    assert state["step"] == 2  # the checkpoint before the failed step is intact
    # settings already in use are not offered again
    _fail_with_oom(monkeypatch, "forward", after_calls=0)
    with pytest.raises(TrainingOutOfMemoryError) as err:
        train(
            _cfg(
                tmp_path / "b",
                "micro_batch_size=1",
                "parallel.activation_checkpointing=true",
            )
        )
    msg = str(err.value)
    assert "training step 1" in msg and "micro_batch_size" not in msg
    assert "activation_checkpointing" not in msg and "shorten data.seq_len" in msg


def test_out_of_memory_in_validation_points_at_the_validation_batch(tmp_path, monkeypatch) -> None:
    from fot.training import TrainingOutOfMemoryError

    _fail_with_oom(monkeypatch, "per_token_loss", after_calls=0)
    with pytest.raises(TrainingOutOfMemoryError) as err:
        train(_cfg(tmp_path / "run", "val_micro_batch_size=2", "val_every_tokens=512"))
    msg = str(err.value)
    assert "validation after step 2: 2 × 64-token sequences" in msg
    assert "lower val_micro_batch_size (now 2;" in msg and "data.val_tokens=0" in msg
    assert "activation_checkpointing" not in msg  # a training setting would not help


def test_train_py_prints_fot_errors_as_one_line(tmp_path) -> None:
    """A corrupt checkpoint (fot's own CorruptCheckpointError, a RuntimeError) is a user error:
    one line with the fix, exit status 2, no traceback."""
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text("{}")
    (ckpt / "model.pt").write_bytes(b"not a torch file")
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, f"resume={ckpt}",
           f"out_dir={run}", f"hydra.run.dir={run}"]  # fmt: skip
    res = _run_script(cmd, cwd=tmp_path, env_extra={"HYDRA_FULL_ERROR": "0"})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert f"train.py: error: checkpoint {ckpt} is corrupt or incomplete" in res.stderr
    assert "raised by" not in res.stderr  # fot raised it: no library location


def test_resume_with_tensors_of_another_model_names_the_file(tmp_path) -> None:
    """A model.pt copied from another run's checkpoint (trainer.json still this run's) used to
    end in load_state_dict's 'Missing key(s)' traceback."""
    from fot.training.checkpoint import CorruptCheckpointError

    train(_cfg(tmp_path / "pro", "total_tokens=512"))
    train(_cfg(tmp_path / "llama", "total_tokens=512", "model=fot_llama"))
    (ckpt,) = list_checkpoints(tmp_path / "pro" / "checkpoints")
    (other,) = list_checkpoints(tmp_path / "llama" / "checkpoints")
    shutil.copy(other / "model.pt", ckpt / "model.pt")
    with pytest.raises(CorruptCheckpointError) as err:
        train(_cfg(tmp_path / "pro", "total_tokens=1024"))
    msg = str(err.value)
    assert f"checkpoint {ckpt} is corrupt or incomplete: cannot read model.pt" in msg, msg
    assert "resume=never" in msg and len(msg) < 1200
    # the same weights in other shapes (an older fot's model, e.g. Samba's MLP widths): not
    # called corrupt, and never "delete it" alone
    wide = "++model.overrides={hidden_size:64,num_hidden_layers:1,num_heads:2}"
    train(_cfg(tmp_path / "wide", "total_tokens=512", wide))
    (other,) = list_checkpoints(tmp_path / "wide" / "checkpoints")
    shutil.copy(other / "model.pt", ckpt / "model.pt")
    with pytest.raises(CorruptCheckpointError) as err:
        train(_cfg(tmp_path / "pro", "total_tokens=1024"))
    msg = str(err.value)
    assert msg.startswith(
        f"checkpoint {ckpt}: model.pt holds weights of other shapes than the model this config "
        "builds (size mismatch for model.embed_tokens.weight: copying a param with shape "
    ), msg
    assert "Either an older fot wrote it" in msg and "resume=never" in msg


def test_resume_refuses_another_model_or_batch_shape_before_loading(tmp_path) -> None:
    """resume=auto in a folder of another model's run used to fail inside load_state_dict (a
    size-mismatch traceback) or, for same-shaped changes, to resume silently."""
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=1024"))
    before = [p.name for p in list_checkpoints(out / "checkpoints")]
    metrics = (out / "metrics.jsonl").read_text()
    cases = {
        "model=fot_llama": "model.name=fot_pro (checkpoint) vs fot_llama (this run)",
        "++model.overrides={hidden_size:64,num_hidden_layers:1,num_heads:2}": (
            "model.overrides={'hidden_size': 32, 'num_hidden_layers': 1, 'num_heads': 2} "
            "(checkpoint) vs {'hidden_size': 64, 'num_hidden_layers': 1, 'num_heads': 2}"
        ),
        "+model.overrides.fgate_bias_init=5": "'fgate_bias_init': 5}",  # same shapes
        "global_batch_tokens=512": "global_batch_tokens=256 (checkpoint) vs 512 (this run)",
        "data.seq_len=32": "data.seq_len=64 (checkpoint) vs 32 (this run)",
    }
    for override, expected in cases.items():
        with pytest.raises(ValueError, match="cannot resume from checkpoint") as err:
            train(_cfg(out, "total_tokens=2048", override))
        assert expected in str(err.value) and "resume=never" in str(err.value), str(err.value)
        assert [p.name for p in list_checkpoints(out / "checkpoints")] == before
        assert (out / "metrics.jsonl").read_text() == metrics


def test_resume_takes_overrides_that_give_the_same_model(tmp_path) -> None:
    """Resuming compared model.overrides as written: an override set to the value the model has
    anyway (a default, a LLaMA name of a FoT setting) was refused as another model. The
    resumed run goes on as the uninterrupted one; another value is still refused."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    train(_cfg(ref, "total_tokens=1024", "data.val_tokens=0"))
    train(_cfg(out, "total_tokens=512", "data.val_tokens=0"))
    same = (
        "++model.overrides={hidden_size:32,num_hidden_layers:1,num_attention_heads:2,"
        "vocab_size:50257,fgate_bias_init:0.0}"
    )
    train(_cfg(out, "total_tokens=1024", "data.val_tokens=0", same))
    assert _losses(out) == _losses(ref)
    other = "++model.overrides={hidden_size:32,num_hidden_layers:1,num_heads:2,fgate_bias_init:1.0}"
    with pytest.raises(ValueError, match=r"cannot resume .*'fgate_bias_init': 1\.0\}"):
        train(_cfg(out, "total_tokens=2048", "data.val_tokens=0", other))


def test_a_run_an_older_fot_started_with_unread_settings_resumes_without_them(
    tmp_path, caplog
) -> None:
    """fot refuses settings the run does not read (a RoPE base without RoPE, hidden_ratio
    beside intermediate_size, schedule=constant with a min_lr_ratio); a run an older fot
    started with them could not go on: kept, they were refused with a fix that changes the
    model (use_rope=true); dropped, the resume named a difference of the same model. Dropping
    them resumes as the uninterrupted run; keeping them says to drop them. The checkpoint
    exports too."""
    from fot.training.trainer import export_checkpoint

    same = ["+model.overrides.intermediate_size=64", "schedule=constant"]
    same += ["schedule.warmup_tokens=512", "data.val_tokens=0"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    train(_cfg(ref, "total_tokens=1024", *same))
    train(_cfg(out, "total_tokens=512", *same))
    for path in (out / "checkpoints").glob("step_*/trainer.json"):  # as an older fot wrote it
        saved = json.loads(path.read_text())
        saved["config"]["model"]["overrides"].update(rope_theta=10000.0, hidden_ratio=3.0)
        saved["config"]["schedule"]["min_lr_ratio"] = 0.1
        path.write_text(json.dumps(saved))
    start = out / "checkpoints" / "step_00000002"
    kept = ["+model.overrides.rope_theta=10000.0", "+model.overrides.hidden_ratio=3.0"]
    with pytest.raises(ValueError) as err:
        train(_cfg(out, "total_tokens=1024", *same, *kept))
    assert str(err.value) == (
        "model.overrides.rope_theta=10000.0 model.overrides.hidden_ratio=3.0: model=fot_pro "
        f"does not read them. The checkpoint this run resumes ({start}) was trained with them "
        "by an older fot, which took them unread: drop model.overrides.rope_theta=10000.0 "
        "model.overrides.hidden_ratio=3.0, and the run resumes unchanged"
    )
    with pytest.raises(ValueError, match=r"drop schedule\.min_lr_ratio=0\.1, and the run resumes"):
        train(_cfg(out, "total_tokens=1024", *same, "schedule.min_lr_ratio=0.1"))
    assert sorted(_losses(out)) == [1, 2]
    with pytest.raises(ValueError) as err:  # a checkpoint without it: the plain refusal
        train(_cfg(ref, "total_tokens=2048", *same, "schedule.min_lr_ratio=0.1"))
    assert "older fot" not in str(err.value) and "drop the override" in str(err.value)
    caplog.set_level(logging.WARNING, logger="fot.train")
    train(_cfg(out, "total_tokens=1024", *same))
    assert _losses(out) == _losses(ref)  # bit-exact
    assert "resuming from" not in caplog.text  # the same model and learning rates: no note
    export_checkpoint(start, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["intermediate_size"] == 64


def test_resume_refuses_another_data_kind_and_warns_for_another_source(tmp_path, caplog) -> None:
    """Resuming on other data used to go on silently from the old run's stream position (or
    fail with KeyError 'position' inside the stream). Another kind or packing is refused; another
    path (a moved folder, or other data on purpose) resumes with a warning naming it."""
    from fot.data.tokens import write_token_documents

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, n, dtype=np.uint16) for n in (300, 200, 500, 400) * 4]
    write_token_documents(tmp_path / "a", docs)
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    tokens = ["data=tokens", f"data.path={tmp_path / 'a'}", "data.val_tokens=0"]
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=512", *tokens))
    before = [p.name for p in list_checkpoints(out / "checkpoints")]
    for overrides, expected in (
        (["data.val_tokens=0"], "data.kind=tokens (checkpoint) vs sample"),
        ([*tokens, "data.packing=padded"], "data.packing=varlen (checkpoint) vs padded"),
    ):
        with pytest.raises(ValueError, match="cannot resume from checkpoint") as err:
            train(_cfg(out, "total_tokens=1024", *overrides))
        assert expected in str(err.value), str(err.value)
        assert [p.name for p in list_checkpoints(out / "checkpoints")] == before
    caplog.set_level(logging.WARNING, logger="fot.train")
    moved = ["data=tokens", f"data.path={tmp_path / 'moved'}", "data.val_tokens=0"]
    assert train(_cfg(out, "total_tokens=1024", *moved))["step"] == 4
    assert f"data.path={tmp_path / 'a'} (checkpoint) vs {tmp_path / 'moved'}" in caplog.text
    assert "checkpoint's position in the data stream" in caplog.text
    assert "the training data changed" not in caplog.text  # moved, not changed


def test_resume_on_rewritten_training_data_says_the_data_changed(tmp_path, caplog) -> None:
    """A token folder rewritten under the same path (e.g. `fot.data.prepare` run again with more
    documents) used to be read from the old run's position without a word: the checkpoint now
    holds a digest of its last step's sequences, and resuming compares it with the data."""
    from fot.data.tokens import write_token_documents

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, n, dtype=np.uint16) for n in (300, 200, 500, 400) * 4]
    data = tmp_path / "tok"
    write_token_documents(data, docs)
    tokens = ["data=tokens", f"data.path={data}", "data.val_tokens=0"]
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=512", *tokens))
    caplog.set_level(logging.WARNING, logger="fot.train")
    train(_cfg(out, "total_tokens=768", *tokens))  # unchanged data: no warning
    assert "the training data changed" not in caplog.text
    write_token_documents(data, [docs[1], *docs])  # one document more, in front
    assert train(_cfg(out, "total_tokens=1024", *tokens))["step"] == 4
    ckpt = out / "checkpoints" / "step_00000003"
    assert (
        f"the training data changed since {ckpt} was written: the sequences of its last step "
        f"(step 3) read now from data.kind=tokens, data.path={data} differ" in caplog.text
    )


def test_resume_digest_covers_every_token_and_reads_older_checkpoints(tmp_path, caplog) -> None:
    """The digest hashed the step's inputs only, so a LongCrawl64 chunk whose last token (a
    label, never an input) changed resumed without a word; it now hashes the labels too. A
    checkpoint written before (``data_digest``: the inputs alone, here computed by hand from
    the array) is still compared its own way: no warning for unchanged data."""
    import hashlib

    from fot.data.streams import EOT_ID

    rng = np.random.default_rng(0)
    data = rng.integers(0, 50000, (8, 128)).astype(np.uint16)
    arr = new_array(str(tmp_path / "lc" / "train.zarr"), shape=data.shape,
                    chunks=(4, 128), dtype="uint16")  # fmt: skip
    arr[:] = data
    lc = ["data=longcrawl64", f"data.path={tmp_path / 'lc'}", "data.val_tokens=0"]
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=512", *lc))  # steps 1-2: sequences 0..7 (column 0)
    ckpt = out / "checkpoints" / "step_00000002"
    state = json.loads((ckpt / "trainer.json").read_text())
    labels = data[4:8, :64].astype(np.int64)  # step 2: rows 4..7 of the first chunk column
    inputs = np.concatenate([np.full((4, 1), EOT_ID), labels[:, :-1]], axis=1)
    del state["data_sha256"]
    caplog.set_level(logging.WARNING, logger="fot.train")
    for changed in (True, False):  # the old digest of other inputs, then of these
        other = inputs.copy()
        other[0, 5] += changed
        state["data_digest"] = hashlib.sha256(other.tobytes()).hexdigest()
        (ckpt / "trainer.json").write_text(json.dumps(state))
        caplog.clear()
        assert train(_cfg(out, "total_tokens=768", f"resume={ckpt}", *lc))["step"] == 3
        assert ("the training data changed" in caplog.text) == changed

    arr[1, 127] = (int(data[1, 127]) + 1) % 50000  # step 3's last label of row 1 (column 1)
    assert train(_cfg(out, "total_tokens=1024", *lc))["step"] == 4
    assert "the training data changed since" in caplog.text


def test_zarr_rows_that_seq_len_does_not_divide_warn_once_with_the_share_lost(tmp_path) -> None:
    """Rows of a zarr array are cut into sequences of data.seq_len, and the remainder of each
    row was dropped without a word (rows of 4,096 tokens with seq_len=3000 lost 27% of the
    data). The run now says so once, at the start (console and train.log), with the divisors
    to use; a seq_len that divides the rows says nothing."""
    for row_len in (96, 128):
        data = np.random.default_rng(0).integers(0, 50000, (8, row_len)).astype(np.uint16)
        array = tmp_path / f"lc{row_len}" / "train.zarr"
        new_array(str(array), shape=data.shape, chunks=(4, row_len), dtype="uint16")[:] = data
        run = tmp_path / f"run{row_len}"
        cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, "data=longcrawl64",
               f"data.path={array.parent}", "data.val_tokens=0", "total_tokens=256",
               f"out_dir={run}"]  # fmt: skip
        proc = _run_script(cmd, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said, logged = proc.stdout + proc.stderr, (run / "train.log").read_text()
        if row_len == 128:
            assert "does not divide" not in said + logged
            continue
        want = (
            f"data.seq_len=64 does not divide the rows of {array} (96 tokens each): each row "
            "gives 1 sequence(s) and its last 32 tokens are never read, 33.3% of the data. Use "
            "a data.seq_len that divides 96, e.g. 48 or 96\n"
        )
        assert said.count(want) == 1, said[-3000:]
        assert logged.count(want) == 1


def test_held_out_zarr_rows_that_seq_len_does_not_divide_warn_once(tmp_path) -> None:
    """data=longcrawl64 warned of the ends of the training rows that data.seq_len leaves
    unread, but not of those of heldout.zarr, whose rows validation cuts the same way: rows
    of 96 tokens at seq_len=64 validated on 2/3 of the held-out data without a word. Its
    array is now named in a warning of its own, once (rank 0: console and train.log)."""
    rng = np.random.default_rng(0)
    root = tmp_path / "lc"
    for name, row_len in (("train.zarr", 128), ("heldout.zarr", 96)):
        data = rng.integers(0, 50000, (8, row_len)).astype(np.uint16)
        new_array(str(root / name), shape=data.shape, chunks=(4, row_len), dtype="uint16")[:] = data
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, "data=longcrawl64",
           f"data.path={root}", "data.val_tokens=128", "total_tokens=256", f"out_dir={run}"]  # fmt: skip
    proc = _run_script(cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said, logged = proc.stdout + proc.stderr, (run / "train.log").read_text()
    want = (
        f"data.seq_len=64 does not divide the rows of {root / 'heldout.zarr'} (96 tokens each): "
        "each row gives 1 sequence(s) and its last 32 tokens are never read, 33.3% of the data. "
        "Use a data.seq_len that divides 96, e.g. 48 or 96\n"
    )
    assert said.count(want) == 1, said[-3000:]
    assert logged.count(want) == 1
    assert said.count("does not divide") == 1  # the training rows (128 tokens) are whole


def test_resume_keeps_this_runs_optimizer_settings_and_the_checkpoints_moments(tmp_path) -> None:
    """Loading the optimizer state replaced every hyperparameter with the checkpoint's: a resumed
    run with another optim.weight_decay/betas/eps trained on with the old ones without a word,
    and the implementation flags (fused; capturable, which parallel.cuda_graphs needs) were the
    saving run's, not this run's."""
    from fot.training.checkpoint import load_checkpoint, save_checkpoint
    from fot.training.config import OptimConfig
    from fot.training.optim import build_optimizer

    def make(cfg: OptimConfig):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        return model, build_optimizer(model, cfg, device=torch.device("cpu"))

    model, opt = make(OptimConfig(weight_decay=0.1, fused=False))
    model(torch.randn(2, 4)).square().sum().backward()
    opt.step()
    state = {"step": 1, "tokens": 1, "data": {}, "sizes": {}}
    path = save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, trainer_state=state,
                           keep_last=1, is_main=True)  # fmt: skip
    model2, opt2 = make(OptimConfig(weight_decay=0.05, betas=[0.8, 0.9], eps=1e-6, fused=True))

    def settings():  # (torch's loading turns betas into a list)
        return [{**g, "params": None, "betas": tuple(g["betas"])} for g in opt2.param_groups]

    want = settings()
    load_checkpoint(path, model=model2, optimizer=opt2, rank=0)
    assert settings() == want
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[p2]["exp_avg_sq"])
        assert torch.equal(p, p2)


def test_a_resume_whose_optimizer_groups_changed_says_so_and_changes_nothing(tmp_path) -> None:
    """A Samba run with optim=muon started before A_log was kept out of Muon holds Muon state
    for A_log: resuming it failed as "corrupt or incomplete: cannot read optim.pt (KeyError:
    'param_groups.0.momentum')". Now the message names the parameter and the two optimizers,
    and the run folder is left byte for byte as it was; AdamW's own regrouping (a parameter
    from the decayed to the non-decayed group) still loads, with the moments of that parameter."""
    from unittest import mock

    from fot.training import optim
    from fot.training.checkpoint import load_checkpoint, save_checkpoint
    from fot.training.config import OptimConfig

    class Mixer(torch.nn.Module):  # stands in for a Mamba layer: a projection and A_log
        def __init__(self) -> None:
            super().__init__()
            self.in_proj = torch.nn.Linear(4, 4, bias=False)
            self.A_log = torch.nn.Parameter(torch.randn(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.in_proj(x).square().sum() + self.A_log.square().sum()

    muon = OptimConfig(name="muon", momentum=0.95, ns_steps=5, adjust_lr="match_rms_adamw")

    def make(cfg: OptimConfig, muon_names: set[str], no_decay: bool = True):
        torch.manual_seed(0)
        model = Mixer()
        with (
            mock.patch.object(optim, "muon_parameter_names", lambda m: muon_names),
            mock.patch.object(optim, "_no_weight_decay", lambda p: no_decay and p.ndim == 2
                              and p.shape[1] == 3),
        ):  # fmt: skip
            return model, optim.build_optimizer(model, cfg, device=torch.device("cpu"))

    def files(root):
        return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    state = {"step": 1, "tokens": 1, "data": {}, "sizes": {}}
    for then, now, want in [
        ({"in_proj.weight", "A_log"}, {"in_proj.weight"}, "A_log in Muon's groups then, AdamW's"),
        ({"in_proj.weight"}, {"in_proj.weight", "A_log"}, "A_log in AdamW's groups then, Muon's"),
    ]:
        root = tmp_path / str(len(then))
        model, opt = make(muon, then)
        model(torch.randn(2, 4)).backward()
        opt.step()
        path = save_checkpoint(root, step=1, model=model, optimizer=opt, trainer_state=state,
                               keep_last=1, is_main=True)  # fmt: skip
        before = files(root)
        model2, opt2 = make(muon, now)
        with pytest.raises(RuntimeError) as err:  # (was CorruptCheckpointError)
            load_checkpoint(path, model=model2, optimizer=opt2, rank=0)
        text = str(err.value)
        assert type(err.value).__name__ == "OptimizerGroupsChangedError", text
        assert f"checkpoint {path}: the optimizer's parameter groups changed" in text
        assert want in text and "corrupt" not in text and f"init_from={path}" in text
        assert files(root) == before
    # AdamW alone, A_log decayed then and not now: its moments follow it by name
    model, opt = make(OptimConfig(fused=False), set(), no_decay=False)
    model(torch.randn(2, 4)).backward()
    opt.step()
    path = save_checkpoint(tmp_path / "adamw", step=1, model=model, optimizer=opt,
                           trainer_state=state, keep_last=1, is_main=True)  # fmt: skip
    model2, opt2 = make(OptimConfig(fused=False), set())
    load_checkpoint(path, model=model2, optimizer=opt2, rank=0)
    assert any(p is model2.A_log for p in opt2.param_groups[1]["params"])  # not decayed now
    assert torch.equal(opt2.state[model2.A_log]["exp_avg"], opt.state[model.A_log]["exp_avg"])


def test_resume_warns_where_the_optimizer_or_lr_schedule_differ(tmp_path) -> None:
    from fot.training.config import to_container
    from fot.training.trainer import check_resume

    was = _cfg(tmp_path)  # 8 steps of 256 tokens, warmup 512, cosine to 0.1 x 0.01
    saved = {"step": 4, "tokens": 1024, "sizes": {}, "config": to_container(was)}
    path = tmp_path / "checkpoints" / "step_00000004"
    assert check_resume(saved, _cfg(tmp_path), path) == []
    assert check_resume(saved, _cfg(tmp_path, "log_every_tokens=512"), path) == []
    notes = check_resume(saved, _cfg(tmp_path, "optim.weight_decay=0.05"), path)
    assert len(notes) == 1 and "optim.weight_decay=0.1 (checkpoint) vs 0.05 (this run)" in notes[0]
    notes = check_resume(saved, _cfg(tmp_path, "schedule.min_lr_ratio=0", "optim.lr=0.02"), path)
    assert len(notes) == 1, notes
    # step 5 ends at 1280 tokens: cosine at (1280 - 512) / 1536 = 1/2 of the way
    assert (
        "the next step's learning rate is 0.01 (it was 0.0055 in the checkpoint's run)" in notes[0]
    )
    assert "optim.lr=0.01 (checkpoint) vs 0.02" in notes[0]
    assert "schedule.min_lr_ratio=0.1 (checkpoint) vs 0.0" in notes[0]
    # a finished run, rerun with them: no step left, so no "next step's learning rate"
    done = {**saved, "step": 8, "tokens": 2048}
    changed = ("schedule.min_lr_ratio=0", "optim.lr=0.02", "optim.weight_decay=0.05")
    assert check_resume(done, _cfg(tmp_path, *changed), path) == []
    assert len(check_resume(done, _cfg(tmp_path, *changed, "total_tokens=4096"), path)) == 2
    # the same batch summed in other parts (helper-174: no warning, and the losses moved in
    # the last bits)
    (note,) = check_resume(saved, _cfg(tmp_path, "micro_batch_size=1"), path)
    assert note == (
        f"resuming from {path} with another implementation setting: micro_batch_size=2 "
        "(checkpoint) vs 1 (this run); the model and training state are the checkpoint's, but "
        "losses may differ from an uninterrupted run in rounding"
    )
    on_2 = {**saved, "sizes": {"world_size": 2}}
    (note,) = check_resume(on_2, _cfg(tmp_path), path, world_size=1)
    assert "another implementation setting: 2 processes (checkpoint) vs 1 (this run)" in note
    assert check_resume(on_2, _cfg(tmp_path), path, world_size=2) == []
    # the same process count, reduced by another strategy: other rounding too
    ddp = {**saved, "sizes": {"world_size": 2, "strategy": "ddp"}}
    (note,) = check_resume(ddp, _cfg(tmp_path), path, world_size=2, strategy="fsdp")
    assert "another implementation setting: parallel.strategy=ddp (checkpoint) vs fsdp" in note
    assert check_resume(ddp, _cfg(tmp_path), path, world_size=2, strategy="ddp") == []
    notes = check_resume(saved, _cfg(tmp_path, f"seed={was.seed + 5}"), path)
    assert len(notes) == 1, notes
    assert f"with seed={was.seed + 5}, but the checkpoint run's seed={was.seed} stays" in notes[0]
    # the next step's LR is the same (the peak: warmup ends there), later ones are not: a note
    # names the first step that differs (there was none, helper-77)
    at_1 = {**saved, "step": 1, "tokens": 256}
    other = ("schedule=warmup_linear", "schedule.min_lr_ratio=0.5", "total_tokens=4096")
    (note,) = check_resume(at_1, _cfg(tmp_path, *other), path)
    # step 3 ends at 768 tokens: cosine 1/6 of the way to 0.001, linear 1/14 of it to 0.005
    assert "step 3's learning rate is 0.00964 (it was 0.0094 in the checkpoint's run)" in note
    assert "schedule.name=warmup_cosine (checkpoint) vs warmup_linear" in note
    # a WSD branch ends sooner by design: only its next step is compared
    wsd = ("schedule=wsd", "schedule.decay_fraction=0.25")
    parent = {**at_1, "config": to_container(_cfg(tmp_path, *wsd, "total_tokens=4096"))}
    shorter = _cfg(tmp_path, *wsd)
    assert check_resume(parent, shorter, path, branching=True) == []
    (note,) = check_resume(parent, shorter, path)
    # step 7 ends at 1792 tokens, half way through the decay over the last 512: 1 - sqrt(1/2)
    assert "step 7's learning rate is 0.00293 (it was 0.01 in the checkpoint's run)" in note


def test_validation_lost_at_the_checkpoint_step_runs_on_resume(tmp_path, monkeypatch) -> None:
    """A run stopped in the validation after its checkpoint (a crash, or SIGTERM, which skips
    it) resumed after that step: metrics.jsonl never got that step's validation record."""
    from fot.training import trainer

    args = ("total_tokens=1024", "val_every_tokens=512")  # validations at steps 2 and 4
    out = tmp_path / "run"
    evaluate, lost = trainer.evaluate, []

    def fail(*a, **k):  # validates (the value the run would have logged), then stops
        lost.append(evaluate(*a, **k)["val/loss"])
        raise RuntimeError("stopped in validation")

    monkeypatch.setattr(trainer, "evaluate", fail)
    with pytest.raises(RuntimeError, match="stopped in validation"):
        train(_cfg(out, *args))
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000002"]
    monkeypatch.setattr(trainer, "evaluate", evaluate)
    got = [json.loads(x) for x in _metrics_lines(train(_cfg(out, *args)))]
    assert [r["step"] for r in got if "val/loss" in r] == [2, 4]
    assert next(r["val/loss"] for r in got if "val/loss" in r) == lost[0]
    assert [r["step"] for r in got if "loss" in r] == [1, 2, 3, 4]
    train(_cfg(out, *args, "total_tokens=1536"))  # logged this time: not validated again
    got = [json.loads(x) for x in _metrics_lines({"checkpoint": str(out / "checkpoints/x")})]
    assert [r["step"] for r in got if "val/loss" in r] == [2, 4, 6]


def test_run_info_cut_short_by_a_crash_does_not_block_the_resume(tmp_path, caplog) -> None:
    """run_info.json was rewritten in place: a kill while writing it left a truncated file, and
    every later start in that folder failed with a JSONDecodeError traceback."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_info.json").write_text('[\n  {\n    "started": "2026-')
    caplog.set_level(logging.WARNING, logger="fot.train")
    train(_cfg(out, "total_tokens=256"))
    runs = json.loads((out / "run_info.json").read_text())
    assert len(runs) == 1 and runs[0]["total_steps"] == 1
    kept = out / "run_info.unreadable.json"
    assert kept.read_text() == '[\n  {\n    "started": "2026-'
    assert str(kept) in caplog.text


def test_final_json_cut_short_by_a_crash_finishes_the_run_again(tmp_path) -> None:
    """final.json was written in place: a kill while writing it left a truncated file, and
    rerunning the finished run failed with a JSONDecodeError traceback."""
    out = tmp_path / "run"
    want = train(_cfg(out, "total_tokens=256"))
    (out / "final.json").write_text('{\n  "step": 1,\n  "tok')
    got = train(_cfg(out, "total_tokens=256"))
    assert json.loads((out / "final.json").read_text()) == got
    assert got["step"] == want["step"] == 1 and got["loss"] == want["loss"]


def test_resume_takes_another_implementation_setting(tmp_path, reference_run, caplog) -> None:
    """Kernel backend, loss implementation and chunk size choose how the same model is computed:
    a resumed run may change them (e.g. a smaller loss chunk after running out of memory) and
    trains on as the uninterrupted run, to rounding. Any other model field is still refused."""
    from fot.training.checkpoint import read_trainer_state
    from fot.training.trainer import check_resume

    out = tmp_path / "run"
    train(_cfg(out))
    with pytest.raises(ValueError, match="cannot resume from checkpoint") as err:
        train(_cfg(out, "+model.overrides.loss_chunk_size=16", "+model.overrides.qk_norm=false"))
    assert "'qk_norm': False}" in str(err.value) and "loss_chunk_size" not in str(err.value)
    caplog.set_level(logging.WARNING, logger="fot.train")
    start = out / "checkpoints" / "step_00000006"
    saved = read_trainer_state(start)
    # parallel.precision=fp32 is what auto is on the CPU: the same compute precision, no note
    train(
        _cfg(
            out, f"resume={start}", "+model.overrides.loss_chunk_size=16", "parallel.precision=fp32"
        )
    )
    assert "model.overrides.loss_chunk_size=unset (checkpoint) vs 16 (this run)" in caplog.text
    assert "precision" not in caplog.text
    # a resume that computes in another precision is named (a bf16 resume of an fp32 run was
    # applied without a note); the checkpoint records how its run computed
    assert saved["compute_precision"] == "fp32"
    bf16 = _cfg(out, "parallel.precision=bf16")
    notes = check_resume(saved, bf16, start, compute="bf16 autocast over fp32 weights")
    assert notes == [
        f"resuming from {start} with another implementation setting: compute precision fp32 "
        "(checkpoint) vs bf16 autocast over fp32 weights (this run); the model and training "
        "state are the checkpoint's, but losses may differ from an uninterrupted run in rounding"
    ]
    # a checkpoint of an older version, without the record: the settings as written
    del saved["compute_precision"]
    notes = check_resume(saved, bf16, start, compute="bf16 autocast over fp32 weights")
    assert len(notes) == 1 and "parallel.precision=auto (checkpoint) vs bf16 (this run)" in notes[0]
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 9))
    assert losses == pytest.approx(reference_run, rel=1e-5, abs=0)
    runs = json.loads((out / "run_info.json").read_text())
    assert runs[-1]["config"]["model"]["overrides"]["loss_chunk_size"] == 16


def test_the_continue_hint_names_what_the_command_as_it_is_would_do() -> None:
    """A stopped run's hint: with resume=auto (or unset) the same command continues; with
    resume=never or resume=<checkpoint> it says to put resume=auto in its place and what the
    command as it is would do (start from scratch, or from that checkpoint again)."""
    from fot.training.signals import continue_hint

    auto = "run the same command with out_dir=r to continue from it (resume=auto)"
    assert continue_hint("r") == continue_hint("r", "auto") == auto
    replace = "run the same command with out_dir=r and resume=auto in place of resume="
    assert continue_hint("r", "never") == (
        f"{replace}never to continue from it (as it is, the command would start over from scratch)"
    )
    assert continue_hint("r", "r/checkpoints/step_00000002") == (
        f"{replace}r/checkpoints/step_00000002 to continue from it (as it is, the command "
        "would start over from that checkpoint)"
    )
    assert continue_hint("r", "never", sweep="s").startswith(
        "run the same command with hydra.sweep.dir=s and resume=auto in place of resume=never "
        "to continue this job and then run the sweep's remaining ones"
    )


def test_ctrl_c_says_which_checkpoint_is_kept_and_how_to_resume(tmp_path) -> None:
    import time

    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, "total_tokens=1048576",
           f"out_dir={run}", f"hydra.run.dir={run}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    # a shell's background job (`bash .ci/run &`) ignores SIGINT, and so would train.py
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 240
    while not list_checkpoints(run / "checkpoints") and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    latest = list_checkpoints(run / "checkpoints")[-1]
    assert f"train.py: interrupted; the latest checkpoint is {latest}" in stderr
    # "run the same command with": right whether or not the command named out_dir (it said
    # "add out_dir=... to the same command" to a command that had it)
    assert f"run the same command with out_dir={run} to continue" in stderr
    assert (
        f"train.py: interrupted; the latest checkpoint is {latest}"
        in (run / "train.log").read_text()
    )
    # the advice works: the same command with that out_dir resumes from that checkpoint
    resumed = _run_script([*cmd[:-2], "total_tokens=4096", f"out_dir={run}",
                           f"hydra.run.dir={run}"], cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "run_info.json").read_text())[-1]["resumed_from"] == str(latest)


def test_a_stopped_sweep_job_says_how_to_continue_the_sweep(tmp_path, reference_run) -> None:
    """SIGTERM in a job of `train.py -m ...` said to run the same command with out_dir=<job
    folder>, which -m refuses (one out_dir for every job). It names the sweep folder, and that
    advice continues the stopped job from its checkpoint and runs the jobs it did not reach."""

    sweep = tmp_path / "sweep"
    # job 1 (2 steps) is the one the stop keeps the sweep from reaching
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *SMALL, "total_tokens=2048,512",
           f"hydra.sweep.dir={sweep}"]  # fmt: skip
    stopped = _run_script(cmd, env_extra={FAULT_ENV: "sigterm_after_step:4"}, cwd=tmp_path)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    ckpt = sweep / "0" / "checkpoints" / "step_00000005"
    assert (
        f"train.py: stopped by SIGTERM after step 5; its checkpoint is {ckpt}: run the same "
        f"command with hydra.sweep.dir={sweep} to continue this job and then run the sweep's "
        "remaining ones (finished jobs are not trained again) (resume=auto)" in stopped.stderr
    )
    assert not (sweep / "1").exists()  # the sweep stopped with its job
    # the advice works (here the command already named the folder)
    again = _run_script(cmd, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((sweep / "0" / "run_info.json").read_text())[-1]["resumed_from"] == str(ckpt)
    assert _losses(sweep / "0") == pytest.approx(reference_run, rel=1e-5, abs=0)
    assert (sweep / "1" / "final.json").is_file() and sorted(_losses(sweep / "1")) == [1, 2]


def test_ctrl_c_while_train_py_starts_is_one_line(tmp_path) -> None:
    """Ctrl-C in the seconds train.py spends importing torch printed a ~50-line traceback."""

    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *SMALL, f"out_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(1.5)  # past `import hydra`, inside `import fot` (torch, transformers: seconds)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr == "\ntrain.py: interrupted while starting; nothing was written\n"
    assert not (tmp_path / "run").exists()


# Ctrl-C delivered where the sweep above rarely lands, at a set point: SIGINT to the process
# itself, from inside the step named, by a script that then runs train.py as `python train.py`.
CTRL_C_AT = """
import os, runpy, signal, sys, time
import hydra._internal.config_loader_impl as loader
import fot.training.config as config
import fot.training.trainer as trainer

def sigint():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler raises in here

def wrap(owner, name, then):
    real = getattr(owner, name)
    def wrapped(*args, **kwargs):
        then()
        return real(*args, **kwargs)
    setattr(owner, name, wrapped)

def as_import_error():  # a library's import, interrupted, reports the module as missing
    try:
        sigint()
    except KeyboardInterrupt:
        raise ModuleNotFoundError("No module named 'numpy.dtypes'")

def swallowed():  # a library that catches everything
    try:
        sigint()
    except BaseException:
        pass

where = sys.argv.pop(1)
if where == "composing":  # Hydra composing the config, after train.py's own start
    wrap(loader.ConfigLoaderImpl, "load_configuration", sigint)
elif where == "import_error":
    wrap(config, "register_configs", as_import_error)
elif where == "swallowed":
    wrap(config, "register_configs", swallowed)
elif where == "training_starts":  # in train(), before the run owns its folder
    wrap(trainer, "resolve_strategy", sigint)
sys.argv[0] = os.path.join(os.environ["FOT_ROOT"], "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("where", ["composing", "import_error", "swallowed", "training_starts"])
def test_ctrl_c_anywhere_before_training_is_one_line(tmp_path, where) -> None:
    """Ctrl-C while Hydra composed the config printed Hydra's ~50-line traceback with status 1,
    and one inside a library's import could come out as that library's ImportError; one that
    a library swallowed let the run start. One in train() before the run owned its folder
    named that folder ("interrupted before the first checkpoint of ...") as it was removed."""
    script = tmp_path / "ctrl_c_at.py"
    script.write_text(CTRL_C_AT)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT), "FOT_ROOT": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script), where, *SMALL],  # the default folder, made while starting
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        # Python's handler (a background job, as under CI, starts with SIGINT ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr == "\ntrain.py: interrupted while starting; nothing was written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctrl_c_at.py"]  # no outputs/


def test_a_run_folder_in_use_by_another_run_is_refused(tmp_path) -> None:
    """Two runs in one folder (one out_dir) wrote each other's checkpoints and metrics: the second is
    refused, naming the first, and changes nothing there; once the first ends, the folder is
    free again."""
    import fcntl

    from fot.training.checkpoint import RUN_LOCK, RunFolderInUseError

    out = tmp_path / "run"
    out.mkdir()
    with open(out / RUN_LOCK, "a+") as held:  # another run's lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242 on node7, started 2026-11-28 10:00:00\n")
        held.flush()
        with pytest.raises(
            RunFolderInUseError, match=r"/run is in use by another run \(pid 4242 on node7, started"
        ):
            train(_cfg(out))
        assert [p.name for p in out.iterdir()] == [RUN_LOCK]
    first = train(_cfg(out, "total_tokens=1024"))
    assert "pid" in (out / RUN_LOCK).read_text()  # this run's record
    again = train(_cfg(out, "total_tokens=1024"))  # released when the run ended
    assert again == first


def test_a_lock_file_removed_between_open_and_flock_is_not_the_lock_taken(
    tmp_path, monkeypatch
) -> None:
    """A refused run removes the lock file it made (RunFolderLock.discard) as it lets the lock
    go. A second run that opened that file just before could flock the removed file and
    train, while a third locked the new file at the path: two runs in one folder. take() now
    checks that the file it locked is the one at the path and opens it again if not."""
    import fcntl

    from fot.training.checkpoint import RUN_LOCK, RunFolderInUseError, RunFolderLock

    out = tmp_path / "run"
    out.mkdir()
    real_flock = fcntl.flock
    calls = []

    def flock_after_the_first_run_discards(f, op):
        if not calls:  # the first run's discard lands between this open and this flock
            (out / RUN_LOCK).unlink()
        calls.append(op)
        return real_flock(f, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_first_run_discards)
    second = RunFolderLock(out)
    second.take()
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert len(calls) == 2  # opened again after the removed file was locked
    held = os.fstat(second._file.fileno())
    at_path = (out / RUN_LOCK).stat()
    assert (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)
    assert f"pid {os.getpid()} on" in (out / RUN_LOCK).read_text()
    with pytest.raises(RunFolderInUseError, match=f"pid {os.getpid()} on"):
        RunFolderLock(out).take()  # a third run is refused
    second.release()
    third = RunFolderLock(out)
    third.take()  # free again once let go
    assert third._file is not None
    third.release()


def test_a_refused_run_leaves_the_folders_hydra_files_as_they_were(tmp_path) -> None:
    """Hydra wrote .hydra/ before train.py ran: a second command in a live run's folder (refused
    by the lock), or one whose settings the checkpoint refuses, replaced the run's
    config.yaml and overrides.yaml with its own. train.py now writes them once the run owns
    the folder; they hold what Hydra would have written."""
    import fcntl

    from fot.training.checkpoint import RUN_LOCK

    run = tmp_path / "run"
    first = [*SMALL, "total_tokens=256", f"out_dir={run}"]
    proc = _run_script([sys.executable, str(ROOT / "train.py"), *first], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hydra = run / ".hydra"
    # the oracle: Hydra's compose of the same overrides
    assert (hydra / "config.yaml").read_text() == OmegaConf.to_yaml(_cfg(run, "total_tokens=256"))
    assert OmegaConf.load(hydra / "overrides.yaml") == first
    assert OmegaConf.load(hydra / "hydra.yaml").hydra.runtime.output_dir == str(run)
    # train.log holds the training record (as metrics.jsonl does), the console does not
    loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert re.search(
        rf"\] - step 1: loss {loss:.4f}, lr .*tokens/s\n", (run / "train.log").read_text()
    )
    assert "step 1: loss" not in proc.stdout + proc.stderr
    kept = {p.name: p.read_bytes() for p in [*hydra.iterdir(), run / "train.log"]}

    def refused(*overrides: str) -> str:
        cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, *overrides, f"out_dir={run}"]
        res = _run_script(cmd, cwd=tmp_path)
        assert res.returncode == 2, res.stderr[-3000:]
        assert {p.name: p.read_bytes() for p in [*hydra.iterdir(), run / "train.log"]} == kept
        return res.stderr

    with open(run / RUN_LOCK, "a+") as held:  # a live run's lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert "is in use by another run" in refused("total_tokens=512")
    assert "cannot resume from checkpoint" in refused("global_batch_tokens=128")


def test_a_run_folder_says_why_its_run_stopped_and_a_refused_run_leaves_none(tmp_path) -> None:
    """train.log ended at the last step line: the error went to the console only (a Slurm
    user reading the run folder never saw it). And a run refused before it began (a missing
    data path) left its new folder behind, holding a lock file and an empty train.log."""
    tokens = np.random.default_rng(0).integers(0, 50000, size=8192).astype(np.uint32)
    tokens[2 * 256 + 5] = 60000  # in step 3's batch
    np.save(tmp_path / "oov.npy", tokens)
    run = tmp_path / "run"
    args = [sys.executable, str(ROOT / "train.py"), *SMALL, "data=tokens", "data.val_tokens=0"]
    res = _run_script([*args, "data.path=oov.npy", f"out_dir={run}"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    error = "train.py: error: the training data of step 3 holds token id 60000, outside the model's"
    assert error in res.stderr
    assert error in (run / "train.log").read_text().splitlines()[-2]  # then the traceback hint
    # refused before it began: no folder, neither the one named nor a default one
    for where in ([f"out_dir={tmp_path / 'new'}"], []):
        res = _run_script([*args, "data.path=missing.npy", *where], cwd=tmp_path)
        assert res.returncode == 2 and "train.py: error: data.path=missing.npy (=" in res.stderr
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob("outputs/*/*"))
    # an existing folder is left as it was: Hydra's empty train.log left it there (earlier
    # files stay, an earlier train.log as it was)
    mine, earlier = tmp_path / "mine", tmp_path / "earlier"
    for folder in (mine, earlier):
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    (earlier / "train.log").write_text("an earlier run's log\n")
    for option in ("out_dir", "hydra.run.dir"):
        for folder in (mine, earlier):
            where = f"{option}={folder}"
            res = _run_script([*args, "data.path=missing.npy", where], cwd=tmp_path)
            assert res.returncode == 2 and "data.path=missing.npy (=" in res.stderr, res.stderr
        assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"], option
        assert sorted(p.name for p in earlier.iterdir()) == ["notes.txt", "train.log"], option
        assert (earlier / "train.log").read_text() == "an earlier run's log\n"


def test_hydras_new_log_stays_in_an_existing_folder_that_another_run_holds(tmp_path) -> None:
    """train.py's clean-up after a run refused before it began takes Hydra's new, empty
    train.log out of an existing folder, but not while another run holds the folder's lock
    (that run may log into it), nor one with lines in it; a lock file it made is removed."""
    import fcntl
    import importlib.util

    spec = importlib.util.spec_from_file_location("_fot_train_py", ROOT / "train.py")
    assert spec is not None and spec.loader is not None
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)  # only its definitions: the run is under __main__
    folder = tmp_path / "run"
    folder.mkdir()
    before = frozenset()
    (folder / "train.log").write_text("")
    with open(folder / ".run.lock", "a") as held:  # a live run's lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        entry.remove_new_unused(folder, before)
        assert sorted(p.name for p in folder.iterdir()) == [".run.lock", "train.log"]
    (folder / ".run.lock").unlink()
    (folder / "train.log").write_text("a line\n")
    entry.remove_new_unused(folder, before)
    assert sorted(p.name for p in folder.iterdir()) == ["train.log"]
    (folder / "train.log").write_text("")
    entry.remove_new_unused(folder, frozenset({"train.log"}))  # it was there before
    assert sorted(p.name for p in folder.iterdir()) == ["train.log"]
    entry.remove_new_unused(folder, before)
    assert list(folder.iterdir()) == []


def test_a_refused_run_leaves_no_empty_parent_folders(tmp_path) -> None:
    """A run refused before it began removed its own folder but left the empty folders made
    for it: ``outputs/<date>/`` (and ``outputs/``) in a fresh checkout, ``multirun/<date>/``
    for a sweep, the missing parents of an ``out_dir``. They go too; a folder that was there
    before stays. And ``-m`` after the overrides was refused as an unrecognized argument: the
    sweep folder's override, added by train.py, came after the flag."""
    args = [*SMALL, "data=tokens", "data.path=no.npy"]
    (tmp_path / "kept").mkdir()
    for before, after in (
        ([], []),
        (["-m"], []),
        ([], ["-m"]),  # the flag after the overrides: Hydra takes both orders
        (["out_dir=made/a/run"], []),
        (["out_dir=kept/b/run"], []),
    ):
        script = [sys.executable, str(ROOT / "train.py"), *before, *args, *after]
        res = _run_script(script, cwd=tmp_path)
        assert res.returncode == 2, (before, after, res.stderr[-3000:])
        assert "train.py: error: data.path=no.npy" in res.stderr, (before, after, res.stderr)
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert list((tmp_path / "kept").iterdir()) == []


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_while_a_checkpoint_is_written(tmp_path, monkeypatch, capsys, presses) -> None:
    """Ctrl-C inside torch.save used to leave half a checkpoint and end in torch's zip-writer
    RuntimeError (a traceback, status 1): now the checkpoint is finished first, then the run
    stops (KeyboardInterrupt); a second Ctrl-C stops at once, as a KeyboardInterrupt too."""
    import io

    from fot.training import checkpoint

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    state = {"step": 1, "tokens": 1, "data": {}, "sizes": {}}

    class Interrupting(io.BytesIO):  # Ctrl-C arrives while torch.save writes the weights
        def write(self, data) -> int:
            if presses > len(sent):
                sent.append(1)
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode
            return super().write(data)

    def interrupted_save(obj, path):
        buffer = Interrupting() if path.name == "model.pt" else io.BytesIO()
        torch.save(obj, buffer)
        path.write_bytes(buffer.getvalue())

    sent: list[int] = []
    monkeypatch.setattr(checkpoint, "_save", interrupted_save)
    # Python's own handler, as in a terminal (a background job, e.g. `bash .ci/run &`, starts
    # with SIGINT ignored, and so would this test)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_checkpoint(tmp_path, step=1, model=model, optimizer=opt,
                                       trainer_state=state, keep_last=1, is_main=True)  # fmt: skip
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "Ctrl-C: finishing the checkpoint of step 1 first" in capsys.readouterr().err
    if presses == 1:  # complete, and loadable
        assert checkpoint.list_checkpoints(tmp_path) == [tmp_path / "step_00000001"]
        loaded = torch.load(tmp_path / "step_00000001" / "model.pt")
        assert torch.equal(loaded["weight"], model.weight)
    else:  # stopped at once: no checkpoint counts (the .tmp folder is cleaned at the next start)
        assert checkpoint.list_checkpoints(tmp_path) == []


def _results(out: Path) -> dict[Path, int]:
    """The modification times of a run folder's files, but the lock that every start rewrites
    with its process id."""
    from fot.training.checkpoint import RUN_LOCK

    return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != RUN_LOCK}


def test_rerunning_a_finished_run_changes_nothing(tmp_path, caplog) -> None:
    """resume=auto on a finished run used to validate and export again and log the final
    validation twice; now it returns the saved results and says how to train on."""
    out = tmp_path / "run"
    first = train(_cfg(out, "total_tokens=1024", "export_hf=true"))
    files = _results(out)
    caplog.set_level(logging.WARNING, logger="fot.train")
    again = train(_cfg(out, "total_tokens=1024", "export_hf=true"))
    assert again == json.loads((out / "final.json").read_text())
    assert again["val/loss"] == first["val/loss"]
    assert _results(out) == files
    assert "already finished" in caplog.text and "raise total_tokens" in caplog.text
    # raising total_tokens trains on from the last checkpoint
    more = train(_cfg(out, "total_tokens=1536"))
    assert more["step"] == 6 and _losses(out).keys() == set(range(1, 7))
    # a checkpoint past a lowered total_tokens (final.json lost, e.g. a crash after the last
    # save) is refused before anything is written; it "finished" at step 6 of 2 without a word
    (out / "final.json").unlink()
    files = _results(out)
    with pytest.raises(ValueError, match=r"step_00000006: it is at step 6 \(1536 tokens\), past "
                                         r"total_tokens=512 \(2 steps\)"):  # fmt: skip
        train(_cfg(out, "total_tokens=512"))
    assert _results(out) == files


def test_resuming_another_runs_last_checkpoint_says_nothing_is_trained(tmp_path, caplog) -> None:
    """resume=<another folder's last checkpoint> with that run's total_tokens trains nothing:
    it validates and exports into the new folder. It said nothing, as if training had run."""
    first = train(_cfg(tmp_path / "a", "total_tokens=1024"))
    last = Path(first["checkpoint"])
    caplog.set_level(logging.WARNING, logger="fot.train")
    out = tmp_path / "b"
    again = train(_cfg(out, "total_tokens=1024", f"resume={last}"))
    # final.json has the checkpoint's training record (from its run's metrics.jsonl) and a
    # validation of its own; it had neither step nor loss
    assert {k: again[k] for k in ("step", "tokens", "loss")} == {
        k: first[k] for k in ("step", "tokens", "loss")
    }
    assert again["val/loss"] == first["val/loss"] and again["checkpoint"] == str(last)
    assert (out / "metrics.jsonl").read_text().count('"val/loss":') == 1
    assert not list(out.glob("checkpoints/step_*"))  # nothing trained, nothing saved
    warning = caplog.text
    assert f"resume={last} is its run's last step (step 4;" in warning
    assert "nothing to train" in warning and "raise total_tokens" in warning
    # its own run's last checkpoint (a finished run again): the message of that case only
    caplog.clear()
    train(_cfg(tmp_path / "a", "total_tokens=1024", f"resume={last}"))
    assert "already finished" in caplog.text and "nothing to train" not in caplog.text


def test_a_branch_from_another_runs_checkpoint_gets_its_own_wandb_run(
    tmp_path, monkeypatch
) -> None:
    """resume=<another folder's checkpoint> (an ablation branched from a shared checkpoint)
    used to resume that run's wandb run, so the branch's records went into the other run's
    charts. A resume in its own folder still goes on in its own wandb run."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the suite disables wandb
    offline = ("wandb.mode=offline", "ckpt_every_tokens=512", "keep_last=4")

    def wandb_ids(out: Path) -> set[str]:
        return {d.name.rsplit("-", 1)[1] for d in (out / "wandb").glob("offline-run-*")}

    a = tmp_path / "a"
    train(_cfg(a, *offline, "total_tokens=1024"))
    (a_id,) = wandb_ids(a)
    step2 = a / "checkpoints" / "step_00000002"
    b = tmp_path / "b"
    train(_cfg(b, *offline, "total_tokens=1024", f"resume={step2}"))
    (b_id,) = wandb_ids(b)
    assert b_id != a_id
    # the same folder resumed from its own earlier checkpoint: the same wandb run
    train(_cfg(a, *offline, "total_tokens=1024", f"resume={step2}"))
    assert wandb_ids(a) == {a_id}


def test_run_stopped_before_final_json_finishes_without_validating_again(tmp_path) -> None:
    """A run that stopped after its final checkpoint but before final.json (e.g. during the HF
    export) used to validate again on resume: a second final validation record in
    metrics.jsonl and a final.json with only the validation values. Now it finishes from the
    records it logged: the same final.json as an uninterrupted run, each record once."""
    out = tmp_path / "run"
    first = train(_cfg(out, "total_tokens=1024"))
    records = (out / "metrics.jsonl").read_text()
    (out / "final.json").unlink()
    again = train(_cfg(out, "total_tokens=1024"))
    assert again == first
    assert json.loads((out / "final.json").read_text()) == first
    assert (out / "metrics.jsonl").read_text() == records  # nothing logged twice
    assert first["step"] == 4 and "loss" in first and "val/loss" in first


def test_resume_inside_a_logging_window_logs_the_uninterrupted_loss(tmp_path) -> None:
    """Checkpoints every 3 steps, logs every 2: resuming from the step-3 checkpoint used to log
    step 4's loss alone instead of the mean over steps 3 and 4 (the window's loss was not
    saved). Every logged loss now equals the uninterrupted run's, bit for bit."""
    sizes = (
        "log_every_tokens=512",
        "ckpt_every_tokens=768",
        "val_every_tokens=768",
        "keep_last=10",
    )
    ref = tmp_path / "ref"
    train(_cfg(ref, *sizes))
    expected = _losses(ref)
    assert sorted(expected) == [2, 4, 6, 8]
    resumed = tmp_path / "resumed"
    shutil.copytree(ref, resumed)
    train(_cfg(resumed, *sizes, f"resume={resumed}/checkpoints/step_00000003"))
    assert _losses(resumed) == expected

    def val_losses(out: Path) -> dict[int, float]:
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["val/loss"] for r in recs if "val/loss" in r}

    assert sorted(val_losses(ref)) == [3, 6, 8]
    assert val_losses(resumed) == val_losses(ref)


def test_tokens_per_s_leaves_out_validation_but_not_the_steps_before_it(
    tmp_path, monkeypatch
) -> None:
    """A validation inside a logging window (here after step 7 of the window of steps 5-8)
    used to restart the window's clock while keeping its steps, so the window's tokens/s
    counted 4 steps over the time of one. It now leaves only the validation's own time out:
    4 steps' tokens over the window's wall time (from the records' elapsed_s) less the
    validation's and the full garbage collection's that comes with it (4fb6d76)."""
    import gc

    import fot.training.trainer as trainer_mod

    events: list[tuple[str, float]] = []  # ("gc" | "eval", seconds) in order
    real, real_collect = trainer_mod.evaluate, gc.collect

    def timed(fn, kind):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if kind == "eval" or not args:  # full collections only
                events.append((kind, time.perf_counter() - t0))
            return out

        return call

    monkeypatch.setattr(trainer_mod, "evaluate", timed(real, "eval"))
    monkeypatch.setattr(gc, "collect", timed(real_collect, "gc"))
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=2048", "log_every_tokens=1024", "val_every_tokens=1792",
               "ckpt_every_tokens=0"))  # fmt: skip
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "val/loss" in r] == [7, 8]
    by_step = {r["step"]: r for r in recs if "loss" in r}
    first_eval = [kind for kind, _ in events].index("eval")
    assert events[first_eval - 1][0] == "gc"  # the collection of the validation's pause
    pause = events[first_eval - 1][1] + events[first_eval][1]
    wall = by_step[8]["elapsed_s"] - by_step[4]["elapsed_s"] - pause
    assert by_step[8]["tokens_per_s"] == pytest.approx(4 * 256 / wall, rel=0.1)


def test_tokens_per_s_leaves_out_the_full_gc_of_checkpoints(tmp_path, monkeypatch) -> None:
    """The full garbage collection that runs at every checkpoint and validation (where every
    rank stops anyway) is part of that pause, not of the training steps. With a collection
    made to take 1.5 s at the checkpoint after step 1, step 2's time (tokens over tokens/s)
    stays at least 1 s below the wall time between the two records (which also holds that
    checkpoint and its collection); with the collection inside the window the two differed
    by the checkpoint's own time only."""
    import gc

    real_collect = gc.collect

    def slow_full_collect(*args):
        if not args:
            time.sleep(1.5)
        return real_collect(*args)

    monkeypatch.setattr(gc, "collect", slow_full_collect)
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=512", "log_every_tokens=256", "ckpt_every_tokens=256",
               "data.val_tokens=0", "gc_every_steps=1"))  # fmt: skip
    first, second = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert (first["step"], second["step"]) == (1, 2)
    step_s = 256 / second["tokens_per_s"]
    assert second["elapsed_s"] - first["elapsed_s"] - step_s > 1.0, (first, second)


def test_tokens_per_s_leaves_out_writing_the_profile(tmp_path, monkeypatch) -> None:
    """Stopping the profiler and writing its summary and trace after the last profiled step
    is no training time: with the writing made to take 1.5 s after step 1 (profiled), step
    2's time (tokens over tokens/s) stays at least 1 s below the wall time between the two
    records; it used to be timed as part of step 2's window."""
    from fot.training.profiling import StepProfiler

    real_write = StepProfiler._write

    def slow_write(self, *args):
        time.sleep(1.5)
        return real_write(self, *args)

    monkeypatch.setattr(StepProfiler, "_write", slow_write)
    out = tmp_path / "run"
    train(_cfg(out, "total_tokens=512", "log_every_tokens=256", "ckpt_every_tokens=0",
               "data.val_tokens=0", "profile.steps=1", "profile.start_step=0",
               "profile.trace=false"))  # fmt: skip
    assert (out / "profile" / "rank0.json").is_file()
    first, second = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert (first["step"], second["step"]) == (1, 2)
    step_s = 256 / second["tokens_per_s"]
    assert second["elapsed_s"] - first["elapsed_s"] - step_s > 1.0, (first, second)


def test_elapsed_s_goes_on_across_a_resume(tmp_path) -> None:
    """elapsed_s restarted from 0 in every resumed run, so loss against wall time ran back at
    each resume. It is the run's wall time: a checkpoint holds the time up to it and a resumed
    run's records go on from there; a checkpoint of an older fot, which holds none, goes on
    from the elapsed_s of its step's record in metrics.jsonl."""

    def logged(out: Path) -> dict[int, float]:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["elapsed_s"] for r in map(json.loads, lines) if "loss" in r}

    out, args = tmp_path / "run", ("total_tokens=1024", "data.val_tokens=0")
    t0 = time.time()
    with pytest.raises(TrainingStopped), pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "sigterm_after_step:1")  # stops after step 2 with its checkpoint
        train(_cfg(out, *args))
    first = time.time() - t0
    step2 = out / "checkpoints" / "step_00000002"
    state = json.loads((step2 / "trainer.json").read_text())
    assert logged(out)[2] <= state["elapsed_s"] < first
    # the time the run took up to step 2, made large to tell it from this process's time
    (step2 / "trainer.json").write_text(json.dumps({**state, "elapsed_s": 1000.0}))
    t0 = time.time()
    train(_cfg(out, *args))
    second = time.time() - t0
    times = logged(out)
    assert sorted(times) == [1, 2, 3, 4]
    assert 1000 < times[3] < times[4] < 1000 + second, times
    # an older fot's checkpoint: its step's record says the time
    del state["elapsed_s"]
    (step2 / "trainer.json").write_text(json.dumps(state))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lines = [{**r, "elapsed_s": 2000.0} if r["step"] == 2 and "loss" in r else r for r in lines]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    t0 = time.time()
    train(_cfg(out, *args, f"resume={step2}"))
    third = time.time() - t0
    times = logged(out)
    assert sorted(times) == [1, 2, 3, 4] and times[2] == 2000.0
    assert 2000 < times[3] < times[4] < 2000 + third, times


def test_sigterm_checkpoints_the_step_and_resume_is_bit_identical(
    tmp_path, reference_run, caplog
) -> None:
    """Slurm, `timeout`, Docker and torchrun stop with SIGTERM: train.py finishes the step it is
    in, checkpoints it, says how to resume and exits with status 143; nothing is lost. A resume
    under another library version says so (run_info.json keeps both)."""
    from fot.provenance import library_versions

    out = tmp_path / "run"
    proc = _small_run_with_fault(out, "sigterm_after_step:4")  # SIGTERM while in step 5
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    ckpt = out / "checkpoints" / "step_00000005"  # not a step of ckpt_every_tokens (2, 4, 6)
    assert list_checkpoints(out / "checkpoints")[-1] == ckpt
    assert "Traceback" not in proc.stderr
    assert (
        f"train.py: stopped by SIGTERM after step 5; its checkpoint is {ckpt}: run the same "
        f"command with out_dir={out} to continue from it (resume=auto)" in proc.stderr
    )
    assert max(_losses(out)) == 5 and not (out / "final.json").exists()
    assert f"train.py: stopped by SIGTERM after step 5; its checkpoint is {ckpt}" in (
        (out / "train.log").read_text()
    )
    # resumed (here in this process), and stopped again in its last step: the final checkpoint
    # is that step's, and resuming once more finishes the run from the records it logged
    caplog.set_level(logging.WARNING, logger="fot.train")
    with pytest.raises(TrainingStopped) as stopped, pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "sigterm_after_step:7")
        train(_cfg(out))  # resume=auto picks step 5
    assert stopped.value.step == 8 and stopped.value.checkpoint.name == "step_00000008"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back after the loop
    assert not (out / "final.json").exists()
    assert "resumes with another fot or other libraries" not in caplog.text  # same as before
    versions = {**library_versions(), "numpy": "0.0.1"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("fot.training.trainer.library_versions", lambda extra: versions)
        result = train(_cfg(out))
    runs = json.loads((out / "run_info.json").read_text())
    assert len(runs) == 3 and runs[-1]["versions"]["numpy"] == "0.0.1"
    assert "wandb" not in runs[0]["versions"]  # wandb.mode=disabled: no wandb files
    said = f"numpy {runs[-2]['versions']['numpy']} -> 0.0.1"
    assert f"resumes with another fot or other libraries than its previous start ({said};" in (
        caplog.text
    ), caplog.text
    assert result["step"] == 8 and "val/loss" in result and (out / "final.json").exists()
    assert _losses(out) == reference_run  # exact float equality, every step


def test_a_stopped_branch_says_to_resume_with_resume_auto(tmp_path) -> None:
    """A run started from another run's checkpoint (resume=<path>) and stopped by SIGTERM or
    Ctrl-C said 'run the same command with out_dir=...': that command, resume=<path> and all,
    starts over from <path> and moves the branch's own checkpoints aside. The line now says to
    put resume=auto in its place, and that continues the branch."""
    from fot.training.checkpoint import interrupted_message

    a = tmp_path / "a"
    train(_cfg(a, "total_tokens=1024"))
    step2 = a / "checkpoints" / "step_00000002"
    b = tmp_path / "b"
    with pytest.raises(TrainingStopped) as stopped, pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "sigterm_after_step:5")
        train(_cfg(b, f"resume={step2}"))
    ckpt = stopped.value.checkpoint
    assert ckpt.parent == b / "checkpoints"
    hint = (
        f"run the same command with out_dir={b} and resume=auto in place of resume={step2} to "
        "continue from it (as it is, the command would start over from that checkpoint)"
    )
    assert str(stopped.value).endswith(f"its checkpoint is {ckpt}: {hint}")
    assert interrupted_message(b, str(step2)).endswith(f"(later steps are lost): {hint}")
    assert "start over from scratch" in interrupted_message(b, "never")
    assert interrupted_message(b, "auto").endswith(f"out_dir={b} to continue from it (resume=auto)")
    result = train(_cfg(b, "resume=auto"))  # as the line says
    assert result["step"] == 8 and not list(b.glob("checkpoints/.abandoned-*"))
    assert sorted(_losses(b)) == list(range(3, 9))  # each step once: nothing trained twice


def test_sigterm_during_validation_stops_it_with_a_checkpoint_of_the_step(tmp_path) -> None:
    """SIGTERM in a long validation (torchrun kills 30 s after passing it on) ended nothing
    until the validation was over (or, in the final one, killed the run without a word); now
    the validation ends early and the run stops with a checkpoint of its step. The resumed
    run validates that step and logs what an uninterrupted run logs, the loss of the logging
    window left open at the stop included."""

    # validations at steps 2, 4, 6; checkpoints at 3 and 6; training records at 3, 6 and 8
    args = ("val_every_tokens=512", "ckpt_every_tokens=768", "log_every_tokens=768")
    whole = tmp_path / "whole"
    train(_cfg(whole, *args))
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped) as stopped, pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "sigterm_in_validation:4")
        train(_cfg(out, *args))
    assert stopped.value.step == 4 and stopped.value.checkpoint.name == "step_00000004"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    before = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in before if "val/loss" in r] == [2]  # step 4's was cut short
    # stopped again in the resumed run's validation of step 4, then in the final validation
    for fault, step in (("sigterm_in_validation:4", 4), ("sigterm_in_validation:8", 8)):
        with pytest.raises(TrainingStopped) as stopped, pytest.MonkeyPatch.context() as mp:
            mp.setenv(FAULT_ENV, fault)
            train(_cfg(out, *args))
        assert stopped.value.checkpoint == out / "checkpoints" / f"step_{step:08d}"
        assert not (out / "final.json").exists()
    train(_cfg(out, *args))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]

    def values(recs: list[dict]) -> list[tuple]:
        keys = ("step", "loss", "val/loss", "val/loss_last_64")
        return [tuple(r.get(k) for k in keys) for r in recs]

    assert values(records) == values(expected)  # exact: the same records in the same order


def test_sigterm_off_dies_at_once(tmp_path) -> None:

    out = tmp_path / "off"
    proc = _small_run_with_fault(out, "sigterm_after_step:5", "checkpoint_on_sigterm=false")
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert list_checkpoints(out / "checkpoints")[-1].name == "step_00000004"


def test_resume_on_a_process_count_that_cannot_split_the_batch_names_counts_that_can(
    tmp_path,
) -> None:
    """A run of 3 sequences per batch, resumed by 2 processes: the size error suggested another
    global_batch_tokens, which the resume then refused; it now names process counts (and any
    micro batch) that keep the checkpoint's batch."""
    out = tmp_path / "run"
    sizes = ["global_batch_tokens=192", "micro_batch_size=1", "total_tokens=384"]
    train(_cfg(out, *sizes, "total_tokens=192"))  # one step, then a resume on 2 processes
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *SMALL, *sizes, "parallel=ddp", f"out_dir={out}",
           f"hydra.run.dir={out}"]  # fmt: skip
    proc = _run_script(cmd, env_extra={"OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode != 0
    ckpt = out / "checkpoints" / "step_00000001"
    assert (
        "cannot be split over 2 process(es) x micro_batch_size=1; the number of sequences must "
        f"be a multiple of world_size * micro_batch_size = 2 (the run resumes from {ckpt}, "
        "whose global_batch_tokens=192 must stay: e.g. 1 process or 3 processes)"
    ) in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("fault", "extra"),
    [("sigterm_after_step:1:1", []), ("sigterm_in_validation:2:1", ["val_every_tokens=512"])],
    ids=["in_step", "in_validation"],
)
def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(
    tmp_path, one_process_run, fault, extra
) -> None:
    """DDP over gloo, SIGTERM to rank 1 only (during step 2, or during the validation after
    it): the ranks agree, both checkpoint step 2, and the resumed run ends with the losses of
    the uninterrupted one-process run."""
    single, _ = one_process_run
    multi = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *SMALL, *_COMMON, *extra, "parallel=ddp", f"out_dir={multi}",
           f"hydra.run.dir={multi}"]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1"}
    proc = _run_script(cmd, env_extra={**env, FAULT_ENV: fault}, cwd=tmp_path)
    assert proc.returncode != 0, proc.stderr[-3000:]
    ckpt = multi / "checkpoints" / "step_00000002"
    assert list_checkpoints(multi / "checkpoints") == [ckpt], proc.stderr[-3000:]
    assert f"stopped by SIGTERM after step 2; its checkpoint is {ckpt}" in proc.stderr
    assert "exitcode  : 143" in proc.stderr  # torchrun's report of the ranks' exit status
    resumed = _run_script(cmd, env_extra=env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    l1, l2 = _losses(single), _losses(multi)
    assert sorted(l2) == [1, 2, 3, 4]
    assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-5)
    assert json.loads((multi / "run_info.json").read_text())[-1]["resumed_from"] == str(ckpt)
    records = [json.loads(x) for x in (multi / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val/loss" in r] == ([2, 4] if extra else [4])


_STUCK_IN_A_COLLECTIVE = """
import sys, time
import torch, torch.distributed as dist
from fot.training.signals import StopOnSigterm

dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
with StopOnSigterm(2) as stop:
    stop.stuck_after_s = 2.0
    if dist.get_rank() == 1:
        time.sleep(120)  # alive, but never joins the collective (as if stuck or dead)
    print("waiting", flush=True)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here, outside Python
"""


def test_sigterm_to_a_process_stuck_in_a_collective_ends_it(tmp_path) -> None:
    """When a rank dies, torchrun sends SIGTERM to the others; one waiting in a collective for
    the dead rank never ran the Python handler and sat there until torchrun's SIGKILL (as
    long as --shutdown-timeout, which the README suggests raising). The watcher ends it."""
    procs = _two_ranks_of(_STUCK_IN_A_COLLECTIVE)
    try:
        assert procs[0].stdout.readline() == "waiting\n"
        time.sleep(0.5)  # into the all_reduce
        sent = time.time()
        procs[0].send_signal(signal.SIGTERM)
        _, err = procs[0].communicate(timeout=30)
        assert procs[0].returncode == 128 + signal.SIGTERM, err[-2000:]
        assert 2.0 <= time.time() - sent < 20
        assert "rank 0: SIGTERM came while this process was waiting outside Python" in err
    finally:
        for p in procs:
            p.kill()
            p.communicate()


_GROUP_TIMEOUTS = """
import torch, torch.distributed as dist
from fot.training.parallel import init_distributed
from fot.training.signals import StopOnSigterm

init_distributed("cpu", "gloo", timeout_s=7.5)
dist.get_backend = lambda group=None: "nccl"  # as on GPUs: SIGTERM's flag gets a gloo group
stop = StopOnSigterm(2)
cpu = torch.device("cpu")
for group in (dist.group.WORLD, stop._group):
    print(group._get_backend(cpu).options._timeout.total_seconds())
"""


def test_parallel_timeout_s_reaches_the_process_group_and_the_sigterm_group(tmp_path) -> None:
    """``parallel.timeout_s`` sets the timeout of the run's process group and of the gloo group
    that SIGTERM's flag is reduced over on GPUs: torch gives a new group its own default (30
    minutes), not the run's group's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-c", _GROUP_TIMEOUTS], env={**env, "RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert out.split() == ["7.5", "7.5"]


def test_a_second_sigterm_changes_nothing() -> None:
    """A rank may get SIGTERM twice (the scheduler's and torchrun's): the second must not kill
    it before the checkpoint (were it to, this test's own process would die)."""

    from fot.training.signals import StopOnSigterm

    with StopOnSigterm(world_size=1) as stop:
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_python_api_logs_the_run_when_nothing_set_up_logging(tmp_path, monkeypatch, capsys):
    """train() called from a script or notebook that configured no logging printed none of the
    run's INFO lines (validations, the export): Python shows only warnings then. It now logs
    them to stderr for the run, and leaves the logger as it was."""
    fot_logger = logging.getLogger("fot.train")
    monkeypatch.setattr(logging.root, "handlers", [])  # as in a fresh interpreter
    level = fot_logger.level
    train(_cfg(tmp_path / "run", "total_tokens=512", "val_every_tokens=256"))
    err = capsys.readouterr().err
    assert re.search(r"\[fot\.train\]\[INFO\] - step 1: val/loss \d", err), err
    assert "[fot.train][INFO] - final validation: {'val/loss': " in err
    assert fot_logger.handlers == [] and fot_logger.level == level
    # with logging set up (train.py's Hydra, an application) nothing is added
    monkeypatch.setattr(logging.root, "handlers", [logging.NullHandler()])
    train(_cfg(tmp_path / "run2", "total_tokens=512", "val_every_tokens=256"))
    assert "[fot.train]" not in capsys.readouterr().err
