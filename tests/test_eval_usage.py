"""``python -m fot.eval`` used wrongly: wrong checkpoint folders, --device cuda without CUDA,
shared --out folders, bad counts, Ctrl-C, unknown lm-eval tasks, the console script's exit
status. Each error must name the problem and the fix, and lose no results."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from eval_helpers import make_llama_checkpoint
from hydra_sweeps import run_empty_sweep

import fot.eval.__main__ as eval_main
from fot.eval.__main__ import cli, main
from fot.eval.common import JsonlLog, check_checkpoint_dir, pick_device, write_run_config

PTL = ["--length", "64", "--max-docs", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")


def _training_run(root):
    """The layout fot's trainer writes: <run>/hf (export) and <run>/checkpoints/step_*."""
    (root / "hf").mkdir(parents=True)
    (root / "hf" / "config.json").write_text("{}")
    step = root / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"")
    (step / "trainer.json").write_text("{}")
    return step


def test_run_folder_and_training_checkpoint_name_the_hf_export(tmp_path):
    step = _training_run(tmp_path / "run")
    hf = str(tmp_path / "run" / "hf")
    with pytest.raises(FileNotFoundError, match="training run folder") as err:
        check_checkpoint_dir(tmp_path / "run")
    assert repr(hf) in str(err.value)
    with pytest.raises(FileNotFoundError, match="training checkpoint") as err:
        check_checkpoint_dir(step)
    assert repr(hf) in str(err.value)
    # <run>/checkpoints: the final export, or a step to export
    with pytest.raises(
        FileNotFoundError, match=r"folder of training checkpoints \(step_00000004\)"
    ) as err:
        check_checkpoint_dir(tmp_path / "run" / "checkpoints")
    assert repr(hf) in str(err.value) and f"fot.export {step} " in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json") as err:
        check_checkpoint_dir(tmp_path / "empty")
    # save_pretrained alone writes no tokenizer, which evaluation needs too
    assert "model.save_pretrained(dir) and tokenizer.save_pretrained(dir)" in str(err.value)


def test_device_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device 'cuda'.*--device cpu"):
        pick_device("cuda")
    with pytest.raises(ValueError, match=r"--device 'gpu0' is not a torch device"):
        pick_device("gpu0")
    assert pick_device("cpu") == torch.device("cpu")


def test_console_script_exits_with_status_0(llama, tmp_path):
    # What the fot-eval script does: sys.exit(main()) with the arguments in sys.argv.
    argv = ["fot-eval", "per-token-loss", str(llama), *PTL, "--out", str(tmp_path / "o")]
    code = f"import sys; from fot.eval.__main__ import main; sys.argv = {argv!r}; sys.exit(main())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "'mean_loss'" not in res.stderr  # the summary dict is not printed as an error
    assert (tmp_path / "o" / "summary.json").is_file()


def _console_script() -> list[str]:
    """The command that runs the ``fot-eval`` console script: the one ``pip install`` wrote
    beside this Python, else (fot not installed here) the call it makes of the entry point that
    pyproject.toml declares, with the script's name as ``sys.argv[0]``."""
    from pathlib import Path

    SCRIPT = "fot-eval"
    for bindir in (Path(sys.executable).parent, Path(sys.prefix) / "bin"):
        script = shutil.which(SCRIPT, path=str(bindir))
        if script:
            return [script]
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    entry = re.search(rf'^{SCRIPT} = "([\w.]+):(\w+)"$', pyproject, re.MULTILINE)
    assert entry, f"pyproject.toml declares no {SCRIPT} script"
    module, function = entry.groups()
    code = (
        f"import sys; from {module} import {function}; sys.argv[0] = {SCRIPT!r}; "
        f"sys.exit({function}())"
    )
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("ran", ["module", "script"])
def test_messages_name_the_program_the_user_ran(ran, tmp_path):
    """Usage lines and errors start with ``fot-eval`` when the console script ran, with
    ``python -m fot.eval`` when the module did; so do the hints inside messages."""
    program = "python -m fot.eval" if ran == "module" else "fot-eval"
    command = [sys.executable, "-m", "fot.eval"] if ran == "module" else _console_script()

    def run(*args):
        return subprocess.run([*command, *args], capture_output=True, text=True, cwd=tmp_path)

    usage = run("needle")  # argparse: no checkpoint, no --out
    assert usage.returncode == 2
    assert usage.stderr.startswith(f"usage: {program} needle ")
    assert f"\n{program} needle: error: the following arguments are required" in usage.stderr
    missing = run("longbench", "ckpt", "--data-dir", "nowhere", "--out", "o")
    assert missing.returncode == 2
    assert missing.stderr.startswith(f"{program} longbench: error: --data-dir 'nowhere' does not")
    assert f"(`{program} longbench --help` says how to get them)" in missing.stderr
    assert run("--help").stdout.startswith(f"usage: {program} [-h] COMMAND")


def test_cli_user_errors_and_ctrl_c_print_a_message_not_a_traceback(tmp_path, monkeypatch, capsys):
    res = subprocess.run(
        [sys.executable, "-m", "fot.eval", "needle", str(tmp_path / "missing"), "--out", "o"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "error: checkpoint" in res.stderr and "is not a folder" in res.stderr

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_main, "main", interrupted)
    # before the first result a new --out goes again: nothing is "saved" in it (helper-177)
    out = tmp_path / "o"
    assert cli(["needle", "x", "--out", str(out)]) == 130
    line = capsys.readouterr().err.strip()
    assert (
        line
        == "python -m fot.eval needle: interrupted before its first result; nothing was written"
    )
    out.mkdir()
    (out / ".run.lock").write_text("")
    assert cli(["needle", "x", "--out", str(out)]) == 130
    assert "before its first result; nothing was written" in capsys.readouterr().err
    (out / "needle_easy.jsonl").write_text("{}\n")
    assert cli(["needle", "x", "--out", str(out)]) == 130
    assert f"finished items are saved in {str(out)!r}: rerun the same command to resume" in (
        capsys.readouterr().err
    )

    # SIGTERM (Slurm's time limit, `timeout`) stops as Ctrl-C does: the commands' own saving
    # on KeyboardInterrupt runs (by default Python would die at once, skipping it)
    saved = []

    def terminated(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # a second one does not cut the saving short
            saved.append(True)

    monkeypatch.setattr(eval_main, "main", terminated)
    assert cli(["needle", "x", "--out", str(out)]) == 128 + signal.SIGTERM
    assert saved == [True]
    err = capsys.readouterr().err
    assert f"needle: stopped by SIGTERM; finished items are saved in {str(out)!r}: rerun the" in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back

    # A SIGTERM handled inside a __del__ (a tokenizer's regex objects have one) only prints its
    # exception; the command still stops after the item it is in (at the next saved result)
    def items_with_a_lost_raise(argv):
        log = JsonlLog(tmp_path / "items.jsonl")
        for i in range(5):
            if i == 1:
                _SignalsInDel()  # made and dropped at once: __del__ runs now
            log.append({"key": i})

    monkeypatch.setattr(eval_main, "main", items_with_a_lost_raise)
    assert cli(["needle", "x", "--out", "o"]) == 128 + signal.SIGTERM
    assert len(JsonlLog(tmp_path / "items.jsonl")) == 2  # items 0 and 1, not all five


def test_a_closed_stdout_at_the_summary_is_quiet_as_in_a_pipe(monkeypatch, capsys):
    """`fot-eval ... | head -1`: the final summary's print met a closed pipe and the command,
    its results all written, said "error: [Errno 32] Broken pipe" with status 2
    (helper-177). It now ends as commands in a pipe do: quiet, status 128 + SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    pipe = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", pipe)
    monkeypatch.setattr(eval_main, "main", lambda argv: print("summary " * 10000, flush=True))
    try:
        assert cli(["needle", "x", "--out", "o"]) == 128 + signal.SIGPIPE
    finally:
        with contextlib.suppress(OSError):
            pipe.close()
    assert capsys.readouterr().err == ""


def test_a_stopped_gates_run_does_not_say_it_resumes(tmp_path, monkeypatch, capsys):
    """gates keeps no partial state (it rewrites its --out whole), so Ctrl-C, SIGTERM and a
    SIGTERM lost while it finished say to run it again, not that rerunning resumes."""
    out = str(tmp_path / "g")

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_main, "main", interrupted)
    assert cli(["gates", "x", "--out", out]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"python -m fot.eval gates: interrupted before it finished; it does not resume, and "
        f"{out!r} may hold an earlier run's results or only part of this one's: rerun the same "
        "command to compute them all again"
    )

    def finishes_after_a_lost_raise(argv):
        _SignalsInDel()
        return {"tokens": 1}

    monkeypatch.setattr(eval_main, "main", finishes_after_a_lost_raise)
    assert cli(["gates", "x", "--out", out]) == 128 + signal.SIGTERM
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"python -m fot.eval gates: stopped by SIGTERM after it had finished: every result is "
        f"saved in {out!r} (all of this run)"
    )
    assert "resume" not in line


class _SignalsInDel:
    """Sends SIGTERM from its ``__del__``, where the raise of the handler is only printed (as
    in a tokenizer's regex objects)."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_lost_while_the_command_finishes_says_every_result_is_saved(
    tmp_path, monkeypatch, capsys
):
    """A SIGTERM whose raise was lost after the last saved result (no check_stop follows)
    still stops with status 143 and says so; the command had finished (it returned 0)."""
    out = tmp_path / "o"

    def finishes_after_a_lost_raise(argv):
        log = JsonlLog(out / "items.jsonl")
        log.append({"key": 0})
        _SignalsInDel()  # the last result is saved: no check_stop follows
        return {"done": 1}

    monkeypatch.setattr(eval_main, "main", finishes_after_a_lost_raise)
    assert cli(["needle", "x", "--out", str(out)]) == 128 + signal.SIGTERM
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"python -m fot.eval needle: stopped by SIGTERM after it had finished: every result is "
        f"saved in {str(out)!r} (rerunning the same command resumes from them)"
    )
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


# Code run before the command that sends the process SIGTERM at one moment once the command
# has saved its last result.
_SIGTERM_AT = {
    # right after the command: cli's StopOnSignal has put the previous handler back
    "after_the_command": (
        "import os, signal, fot.interrupt as fi; leave = fi.StopOnSignal.__exit__; "
        "fi.StopOnSignal.__exit__ = lambda self, *exc: "
        "(leave(self, *exc), os.kill(os.getpid(), signal.SIGTERM))[0]"
    ),
    # while Python shuts down after the command returned its exit status, with Python code
    # still to run after it (other exit handlers)
    "at_exit": (
        "import atexit, os, signal; "
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), None)[1])"
    ),
    # the same after the last Python code of the shutdown has run
    "at_exit_last": (
        "import atexit, os, signal; atexit.register(os.kill, os.getpid(), signal.SIGTERM)"
    ),
}


@pytest.mark.parametrize("moment", list(_SIGTERM_AT))
@pytest.mark.parametrize("ran", ["module", "script"])
def test_sigterm_after_the_command_finished_says_so_with_status_143(llama, tmp_path, moment, ran):
    """SIGTERM after the last result is saved (Slurm's time limit, ``timeout``) exits with
    status 143 and one line saying what is saved where; it killed the process without a word.
    Both entry points: ``python -m fot.eval`` (its ``__main__``) and the ``fot-eval`` script
    (``sys.exit(main())`` with the script as ``sys.argv[0]``)."""
    out = tmp_path / "o"
    args = ["per-token-loss", str(llama), *PTL, "--out", str(out)]
    if ran == "module":
        program = "python -m fot.eval"
        run = (f"import runpy, sys; sys.argv = ['fot.eval', *{args!r}]; "
               "runpy.run_module('fot.eval', run_name='__main__', alter_sys=True)")  # fmt: skip
    else:
        program = "fot-eval"
        run = (f"import sys; from fot.eval.__main__ import main; sys.argv = ['fot-eval', "
               f"*{args!r}]; sys.exit(main())")  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-c", f"{_SIGTERM_AT[moment]}\n{run}"], capture_output=True, text=True
    )
    if moment == "at_exit_last" and sys.version_info < (3, 11):
        # CPython 3.10 runs a signal's Python handler only before further Python code: after
        # the last of it, the process ends with the command's status 0, every result saved
        assert res.returncode == 0, res.stderr[-2000:]
        assert "SIGTERM" not in res.stderr
        assert (out / "summary.json").is_file()
        return
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"{program} per-token-loss: stopped by SIGTERM after it had finished: every result is "
        f"saved in {str(out)!r} (rerunning the same command resumes from them)"
    )
    assert (out / "summary.json").is_file()


def test_missing_overlay_is_refused_before_the_evaluation(llama, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(FileNotFoundError, match=r"--overlay 'old=.*nowhere'"):
        main(["per-token-loss", str(llama), *PTL, "--overlay", f"old={tmp_path / 'nowhere'}",
              "--out", str(out)])  # fmt: skip
    assert not (out / "state.npz").exists()  # nothing was evaluated
    main(["per-token-loss", str(llama), *PTL, "--out", str(out)])
    main(["per-token-loss", str(llama), *PTL, "--overlay", f"old={out}", "--out", str(tmp_path / "n")])  # fmt: skip
    assert (tmp_path / "n" / "per_token_loss.png").is_file()


def test_a_second_command_in_the_same_out_keeps_the_first_ones_results(llama, tmp_path):
    out = tmp_path / "o"
    summary = main(["per-token-loss", str(llama), *PTL, "--out", str(out)])
    with pytest.raises(FileExistsError, match=r"per-token-loss results.*summary\.json"):
        main(["forgetting-curve", str(llama), "--lengths", "64", "--repeats", "1", "--out",
              str(out)])  # fmt: skip
    assert json.loads((out / "summary.json").read_text()) == summary
    fc = main(["forgetting-curve", str(llama), "--lengths", "64", "--repeats", "1", "--out",
               str(out / "forgetting_curve")])  # fmt: skip
    assert fc["per_length"][0]["length"] == 64


def test_run_config_of_an_earlier_command_is_kept(tmp_path):
    write_run_config(tmp_path, "needle", {"mode": "easy"}, None)
    write_run_config(tmp_path, "needle", {"mode": "passkey"}, None)
    assert json.loads((tmp_path / "run_config.json").read_text())["arguments"]["mode"] == "passkey"
    history = (tmp_path / "run_config.history.jsonl").read_text().splitlines()
    assert [json.loads(line)["arguments"]["mode"] for line in history] == ["easy"]


def test_needle_depths_are_checked_before_anything_is_loaded_or_written(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"--depths '0,150'.*\[150\.0\]"):
        main(["needle", str(tmp_path / "missing"), "--depths", "0,150", "--out", str(out)])
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["per-token-loss", "--length", "64"],
        ["forgetting-curve", "--lengths", "64"],
        ["needle"],
        ["gates"],
        ["lm-eval", "--tasks", "TASK_FILE"],
    ],
    ids=lambda a: a[0],
)
def test_a_missing_checkpoint_leaves_no_out_folder(argv, tmp_path):
    if "TASK_FILE" in argv:  # a task file (a built-in task name costs lm-eval's whole index)
        data = tmp_path / "qa.jsonl"
        data.write_text('{"q": "Is it?", "a": " yes"}\n')
        task = tmp_path / "fot_qa.yaml"
        task.write_text(
            "task: fot_qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\noutput_type: loglikelihood\n"
            "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\nmetric_list:\n  - metric: acc\n"
        )
        argv = [str(task) if a == "TASK_FILE" else a for a in argv]
    out = tmp_path / "new" / "results"
    with pytest.raises(FileNotFoundError, match="missing"):
        main([argv[0], str(tmp_path / "missing"), *argv[1:], "--device", "cpu", "--out", str(out)])
    assert not (tmp_path / "new").exists()


def test_lm_eval_offline_dataset_error_says_what_to_do(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from fot.eval.lm_eval_adapter import evaluate

    def offline(**kw):
        raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    with pytest.raises(ConnectionError, match=r"'piqa'.*--dataset-root ROOT.*--list-datasets"):
        evaluate(object(), ["piqa"], out=tmp_path, task_manager=object())


def test_only_empty_lm_eval_request_caches_are_dropped(tmp_path):
    """A failed run's empty request cache is deleted; one holding a finished request (resume
    state) and a file that is no sqlite database are kept."""
    pytest.importorskip("lm_eval")
    from sqlitedict import SqliteDict

    from fot.eval.lm_eval_adapter import drop_empty_request_caches

    with SqliteDict(str(tmp_path / "lm_cache_rank0.db"), autocommit=True):
        pass  # what lm-eval leaves when the dataset load fails
    with SqliteDict(str(tmp_path / "lm_cache_rank1.db"), autocommit=True) as db:
        db["request"] = (-1.5, True)
    (tmp_path / "lm_cache_rank2.db").write_bytes(b"not sqlite")
    assert drop_empty_request_caches(tmp_path) == [tmp_path / "lm_cache_rank0.db"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm_cache_rank1.db", "lm_cache_rank2.db"]
    with SqliteDict(str(tmp_path / "lm_cache_rank1.db")) as db:
        assert db["request"] == (-1.5, True)


def test_a_hub_repository_id_is_downloaded_and_labelled_by_its_name(llama, tmp_path, monkeypatch):
    """`per-token-loss owner/name`: the hub's snapshot_download (replaced here by a copy laid
    out as the hub's cache lays it out) gives the folder; the plot is labelled with the
    repository's name, not the snapshot's commit, and run_config.json keeps the id."""
    import huggingface_hub

    from fot.eval.common import checkpoint_label

    snapshot = tmp_path / "hub" / "models--owner--tiny-llama" / "snapshots" / "0123abc"
    shutil.copytree(llama, snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(snapshot))
    assert checkpoint_label(snapshot) == "tiny-llama"
    out = tmp_path / "o"
    main(["per-token-loss", "owner/tiny-llama", *PTL, "--out", str(out)])
    record = json.loads((out / "run_config.json").read_text())
    assert record["arguments"]["checkpoint_hub_id"] == "owner/tiny-llama"
    assert record["checkpoint"] == str(snapshot.resolve())
    assert (out / "summary.json").is_file()


def test_trainer_export_is_labelled_by_its_run_and_overlay_labels_are_unique(llama, tmp_path):
    from fot.eval.common import checkpoint_label

    (tmp_path / "fot_pro_run" / "hf").mkdir(parents=True)
    assert checkpoint_label(tmp_path / "fot_pro_run" / "hf") == "fot_pro_run"
    assert checkpoint_label(tmp_path / "fot_pro_run" / "hf" / ".") == "fot_pro_run"
    assert checkpoint_label(llama) == "llama"
    first = tmp_path / "a" / "ptl"
    main(["per-token-loss", str(llama), *PTL, "--out", str(first)])
    (tmp_path / "b").mkdir()
    shutil.copytree(first, tmp_path / "b" / "ptl")
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"label 'ptl' is used twice"):  # one curve would vanish
        main(["per-token-loss", str(llama), *PTL, "--overlay", str(first),
              str(tmp_path / "b" / "ptl"), "--out", str(out)])  # fmt: skip
    with pytest.raises(ValueError, match=r"label 'llama' is also this run's label"):
        main(["per-token-loss", str(llama), *PTL, "--overlay", f"llama={first}", "--out",
              str(out)])  # fmt: skip
    assert not (out / "state.npz").exists()


def test_the_jobs_of_a_sweep_are_labelled_by_their_swept_overrides(tmp_path):
    """A multirun's exports are <sweep>/0/hf, <sweep>/1/hf, ...: labelled 0, 1, ... in every
    legend before. The sweep here is a real Hydra multirun (of an app that does nothing)."""
    from fot.eval.common import checkpoint_label

    sweep = run_empty_sweep(tmp_path, "+model=fot_pro,fot_llama", "+lr=1", "+seed=range(0,2)")
    labels = []
    for job in sorted(sweep.glob("[0-9]")):
        (job / "hf").mkdir()
        labels.append(checkpoint_label(job / "hf"))
    assert sorted(labels) == [
        f"model={m},seed={s}" for m in ("fot_llama", "fot_pro") for s in (0, 1)
    ]
    # a run folder named by a number outside a sweep keeps its name
    (tmp_path / "7" / "hf").mkdir(parents=True)
    assert checkpoint_label(tmp_path / "7" / "hf") == "7"
    # the sweep folder passed as a checkpoint names its runs' exports
    (sweep / "0" / "hf" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"holds 1 training run, .*s/0/hf'\)$"):
        check_checkpoint_dir(sweep)


def test_a_value_with_commas_that_every_job_shares_is_not_in_the_labels(tmp_path):
    """A sweep given the README's ``++model.overrides={hidden_size:256,num_heads:4}`` (one dict
    for every job) labelled its jobs 'model=fot_pro,model.overrides={hidden_size:...}': the
    comma in the dict, a list or a quoted string was taken for a sweep's, so each legend and
    wandb name carried the shared value and, with several such, the swept one got lost."""
    from fot.eval.common import checkpoint_label

    sweep = run_empty_sweep(tmp_path, "+model=fot_pro,fot_llama",
                            "++overrides={hidden_size:32,num_heads:2}", "+tags=[a,b]",
                            "+note='x,y'")  # fmt: skip
    labels = []
    for job in sorted(sweep.glob("[0-9]")):
        (job / "hf").mkdir()
        labels.append(checkpoint_label(job / "hf"))
    assert sorted(labels) == ["model=fot_llama", "model=fot_pro"]


@pytest.mark.parametrize(
    "argv",
    [
        ["per-token-loss", "--batch-size", "0"],
        ["per-token-loss", "--max-docs", "0"],  # was: silently every document
        ["needle", "--repeats", "0"],
        ["needle", "--max-new-tokens", "0"],  # was: silently the default
        ["gates", "--max-tokens", "0"],
        ["longbench", "--data-dir", "d", "--limit", "0"],
    ],
)
def test_counts_below_one_are_usage_errors(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([argv[0], str(tmp_path), *argv[1:], "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}: expected an integer >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("spelled", ["per_token_loss", "forgetting_curve", "lm_eval"])
def test_a_command_spelled_with_underscores_is_the_command(spelled, tmp_path, capsys):
    """`per_token_loss` (the module's name) was refused as an invalid choice; it is the
    command `per-token-loss`, with that command's options and messages."""
    with pytest.raises(SystemExit) as exit_:
        main([spelled, str(tmp_path / "missing"), "--lenght", "8", "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    command = spelled.replace("_", "-")
    assert line.startswith(f"python -m fot.eval {command}: error: unrecognized arguments"), line
    assert eval_main.spell_command(["--help"]) == ["--help"]
    assert eval_main.spell_command([spelled, "a_b"]) == [command, "a_b"]


def test_a_mistyped_option_is_named_with_the_option_meant(tmp_path, capsys):
    """`per-token-loss CKPT --lenght 512` printed the top-level usage and `python -m fot.eval:
    error: unrecognized arguments: --lenght 512`, naming neither the command nor the option
    meant (found trying eval/README.md's commands with typos)."""
    out = str(tmp_path / "o")
    with pytest.raises(SystemExit) as exit_:
        main(["per-token-loss", str(tmp_path), "--lenght", "512", "--out", out])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m fot.eval per-token-loss ")
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        "python -m fot.eval per-token-loss: error: unrecognized arguments: --lenght 512 "
        "(--lenght: did you mean --length"
    ), line
    # the option named is what the command's own parser reads
    meant = re.search(r"did you mean (--[\w-]+)", line).group(1)
    args = eval_main.build_parser().parse_args(
        ["per-token-loss", str(tmp_path), meant, "512", "--out", out]
    )
    assert args.length == "512"
    # an option like no known one points at the command's --help
    with pytest.raises(SystemExit):
        main(["gates", str(tmp_path), "--zzz", "--out", out])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m fot.eval gates: error: unrecognized arguments: --zzz "
        "(see python -m fot.eval gates --help)"
    )
    assert not (tmp_path / "o").exists()


def test_lm_eval_unknown_task_is_named_before_the_model_loads(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    import fot.eval.lm_eval_adapter as adapter

    # lm-eval's own task index takes seconds to build: a stand-in that knows piqa only.
    monkeypatch.setattr(
        adapter, "_task_manager", lambda *_: SimpleNamespace(task_index={"piqa": 0})
    )
    with pytest.raises(ValueError, match=r"knows no task \['nosuchtask'\].*--include-path"):
        main(["lm-eval", str(tmp_path / "missing"), "--tasks", "piqa,nosuchtask", "--out",
              str(tmp_path / "o")])  # fmt: skip
    with pytest.raises(ValueError, match=r"knows no task \['nosuchtask'\]"):
        main(["lm-eval", str(tmp_path / "missing"), "--tasks", "nosuchtask", "--list-datasets",
              "--out", str(tmp_path / "o")])  # fmt: skip


def test_a_learned_position_table_is_a_limit_named_before_the_evaluation(tmp_path):
    """GPT-2-style models index a table of n_positions: past it they crash with an IndexError
    deep inside (the oracle below). Every command that feeds long inputs says so up front."""
    from eval_helpers import make_gpt2_checkpoint

    from fot.eval.common import check_positions, load_checkpoint, position_table

    ckpt = make_gpt2_checkpoint(tmp_path / "gpt2", n_positions=128)
    model, _ = load_checkpoint(ckpt, device="cpu", dtype="float32")
    model(torch.zeros(1, 128, dtype=torch.long))  # the whole table is usable
    with pytest.raises(IndexError):
        model(torch.zeros(1, 129, dtype=torch.long))
    assert position_table(model) == (128, "transformer.wpe")
    check_positions(model, 128, "--length 128")
    llama, _ = load_checkpoint(make_llama_checkpoint(tmp_path / "llama", max_len=64), device="cpu")
    assert position_table(llama) is None  # rotary: no table, longer inputs run
    data = tmp_path / "lb"
    data.mkdir()
    (data / "trec.jsonl").write_text(
        json.dumps(
            {"_id": "t", "input": "q", "context": "c", "answers": ["a"], "all_classes": ["Entity"]}
        )
        + "\n"
    )
    for argv in (
        ["per-token-loss", "--length", "256"],
        ["needle", "--lengths", "64,120", "--max-new-tokens", "16"],  # 120 + 16 - 1 > 128
        ["forgetting-curve", "--lengths", "64,256", "--repeats", "1"],
        ["longbench", "--data-dir", str(data), "--tasks", "trec", "--max-length", "100"],
    ):
        out = tmp_path / argv[0]
        with pytest.raises(ValueError, match=r"learned position table \(transformer\.wpe\) of 128"):
            main([argv[0], str(ckpt), *argv[1:], "--device", "cpu", "--out", str(out)])
        assert not out.exists()


def test_longbench_max_length_past_a_position_table_names_the_value_that_fits(tmp_path):
    """--max-length counts LongBench's prompt tokens only (BOS and the generated ones come on
    top); past a learned position table the error said to "choose values that keep inputs
    within 128 tokens", which --max-length 128 does not, without the value that does. It now
    names it, and a --max-length below 2 is named, not blamed on the model's context length.
    Oracle: the table's size less hotpotqa's 32 generated tokens and BOS, and a run with it."""
    from eval_helpers import make_gpt2_checkpoint

    ckpt = make_gpt2_checkpoint(tmp_path / "gpt2", n_positions=128)
    data = tmp_path / "lb"
    data.mkdir()
    row = {"_id": "h", "input": "Which topic?", "context": "Rivers run. " * 80, "answers": ["x"]}
    (data / "hotpotqa.jsonl").write_text(json.dumps(row) + "\n")
    argv = ["longbench", str(ckpt), "--data-dir", str(data), "--tasks", "hotpotqa",
            "--device", "cpu", "--out", str(tmp_path / "o")]  # fmt: skip
    fits = 128 - 32 - 1
    with pytest.raises(ValueError, match=rf"pass --max-length {fits} or less \(or leave it out"):
        main([*argv, "--max-length", "128"])
    with pytest.raises(ValueError, match=r"--max-length 1 leaves no room for a prompt"):
        main([*argv, "--max-length", "1"])
    assert not (tmp_path / "o").exists()
    main([*argv, "--max-length", str(fits)])  # the advice works
    pred = json.loads((tmp_path / "o" / "pred_hotpotqa.jsonl").read_text())
    assert pred["prompt_tokens"] == fits + 1
    # narrativeqa generates 128 tokens: with BOS no prompt fits a table of 128 at any
    # --max-length, which the error said to pass; now it says why only leaving it out works
    (data / "narrativeqa.jsonl").write_text(json.dumps({**row, "_id": "n"}) + "\n")
    argv[argv.index("hotpotqa")] = "narrativeqa"
    with pytest.raises(ValueError) as err:
        main([*argv[:-1], str(tmp_path / "n")])
    assert str(err.value) == (
        "the model's context length 128 leaves no room for the prompts of narrativeqa (128 "
        "generated tokens); the model takes at most 128 positions (its learned position "
        "table), so leave these tasks out of --tasks"
    )
    ckpt_256 = make_gpt2_checkpoint(tmp_path / "gpt2_256", n_positions=256)
    with open(ckpt_256 / "config.json") as f:  # a context length below the table's: it fits
        config = json.load(f)
    config["train_length"] = 128
    (ckpt_256 / "config.json").write_text(json.dumps(config))
    argv[argv.index(str(ckpt))] = str(ckpt_256)
    with pytest.raises(ValueError, match=r"generated tokens\); pass --max-length \(prompt tok"):
        main([*argv[:-1], str(tmp_path / "n")])
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize(
    ("argv", "error", "message"),
    [
        (["--needle", "The cat sat.", "--question", "Who sat?"], ValueError, "--key-phrases"),
        (["--key-phrases", "sandwich"], ValueError, "--needle, --question and --key-phrases"),
        (["--needle", "The cat sat.", "--question", "Who?", "--key-phrases", "dog"], ValueError,
         r"\['dog'\] do not appear in the needle"),
        (["--mode", "passkey", "--needle", "x", "--question", "y", "--key-phrases", "x"],
         ValueError, "passkey mode hides a random key"),
        (["--lengths", "1k,1024"], ValueError, "--lengths lists 1024 more than once"),
        (["--lengths", "0,64"], ValueError, "--lengths: 0 below"),
        (["--depths", "50,50"], ValueError, "--depths lists 50 more than once"),
        (["--haystack", "/no/such/books"], FileNotFoundError, "--haystack '/no/such/books'"),
        # `--haystack $BOOKS` with BOOKS unset: was the sample corpus (passkey: the filler)
        (["--haystack"], ValueError, "--haystack names no file or folder"),
        (["--mode", "passkey", "--haystack"], ValueError, "--haystack names no file or folder"),
        # `--haystack "$BOOKS"`: was every .txt under the current folder (a checkpoint's
        # merges.txt included)
        (["--haystack", ""], ValueError, "--haystack '' names no file or folder"),
        # `--prompt-template "$TPL"` with TPL unset: was fot's own wording, without a word
        (["--prompt-template", ""], ValueError, "--prompt-template '' names no file"),
    ],
    ids=["no-key-phrases", "key-phrases-alone", "phrase-not-in-needle", "passkey-needle",
         "repeated-length", "zero-length", "repeated-depth", "missing-haystack",
         "empty-haystack", "empty-passkey-haystack", "empty-string-haystack",
         "empty-prompt-template"],
)  # fmt: skip
def test_needle_inputs_are_checked_before_the_model_loads(tmp_path, argv, error, message):
    out = tmp_path / "o"
    with pytest.raises(error, match=message):
        main(["needle", str(tmp_path / "missing"), *argv, "--out", str(out)])
    assert not out.exists()


def test_inputs_known_only_with_the_model_leave_no_out_folder(llama, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ValueError, match="no room for a haystack") as info:
        main(["needle", str(llama), "--lengths", "8,64", "--device", "cpu", "--out", str(out)])
    assert not out.exists()
    # named as the option typed, with the shortest length that fits (it said `context_length
    # 8 ...; use a longer context length`)
    shortest = int(re.search(r"at least (\d+)$", str(info.value)).group(1))
    assert str(info.value).startswith("--lengths 8: a prompt of 8 tokens")
    main(["needle", str(llama), "--lengths", str(shortest), "--depths", "50",
          "--max-new-tokens", "1", "--device", "cpu", "--out", str(out)])  # fmt: skip
    with pytest.raises(ValueError, match="no room for a haystack"):
        main(["needle", str(llama), "--lengths", str(shortest - 1), "--depths", "50",
              "--max-new-tokens", "1", "--device", "cpu", "--out", str(tmp_path / "p")])  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "error", "message"),
    [
        (["--lengths", "4,64"], ValueError, "--lengths: 4 below the smallest allowed value 6"),
        (["--lengths", "64,64"], ValueError, "--lengths lists 64 more than once"),
        (["--data", "/no/such/data"], FileNotFoundError, "/no/such/data"),
    ],
    ids=["too-short", "repeated", "missing-data"],
)
def test_forgetting_curve_inputs_are_checked_before_the_model_loads(tmp_path, argv, error, message):
    out = tmp_path / "o"
    with pytest.raises(error, match=message):
        main(["forgetting-curve", str(tmp_path / "missing"), *argv, "--out", str(out)])
    assert not out.exists()


def test_longbench_bad_task_files_and_budgets_are_named_before_any_task_runs(tmp_path):
    data = tmp_path / "lb"
    data.mkdir()
    example = {"_id": "q0", "input": "Q?", "context": "ctx", "answers": ["a"]}
    (data / "hotpotqa.jsonl").write_text(json.dumps(example) + "\n")
    trec = {**example, "all_classes": ["Abbreviation", "Entity"]}
    (data / "trec.jsonl").write_text(json.dumps(trec) + "\n" + '{"_id": "q1", "input"\n')
    (data / "samsum.jsonl").write_text("\n")
    out = tmp_path / "o"
    missing = str(tmp_path / "missing")
    base = ["longbench", missing, "--data-dir", str(data), "--out", str(out), "--tasks"]
    with pytest.raises(ValueError, match=re.escape(f"{data / 'trec.jsonl'}:2 is not valid JSON")):
        main([*base, "hotpotqa,trec"])
    # TREC is scored by classification: a row without its class names used to fail only after
    # generating, without naming the file
    (data / "trec.jsonl").write_text(json.dumps(trec) + "\n" + json.dumps(example) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{data / 'trec.jsonl'}:2 has no class names")):
        main([*base, "trec"])
    # results are keyed by _id: a repeated one used to drop an example from the score silently
    (data / "trec.jsonl").write_text(json.dumps(trec) + "\n" + json.dumps(trec) + "\n")
    with pytest.raises(
        ValueError, match=re.escape(f"{data / 'trec.jsonl'}:2 repeats the _id 'q0' of line 1")
    ):
        main([*base, "trec"])
    with pytest.raises(ValueError, match=re.escape(f"{data / 'samsum.jsonl'} holds no examples")):
        main([*base, "hotpotqa,samsum"])
    # `--prompts "$PROMPTS"` with PROMPTS unset: was fot's own wording, said only in table2.md
    with pytest.raises(ValueError, match=r"--prompts '' names no file"):
        main([*base, "hotpotqa", "--prompts", ""])
    # `--data-dir "$LONGBENCH"` with LONGBENCH unset: '' was the current folder ('. lacks ...')
    with pytest.raises(ValueError, match=r"^--data-dir is empty \(an unset variable\?\); name"):
        main([*base[:2], "--data-dir", "", *base[4:], "hotpotqa"])
    # A 64-token model: hotpotqa (32 generated tokens) fits, narrativeqa (128) does not; the
    # second task is refused before the first one runs.
    (data / "narrativeqa.jsonl").write_text(json.dumps(example) + "\n")
    short = make_llama_checkpoint(tmp_path / "short", max_len=64)
    with pytest.raises(ValueError, match=r"context length 64 leaves no room .* narrativeqa \(128"):
        main(["longbench", str(short), *base[2:], "hotpotqa,narrativeqa", "--device", "cpu"])
    assert not out.exists()
