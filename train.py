"""Train a FoT (or baseline) language model: ``python train.py`` (tiny run on the sample
corpus), ``torchrun --nproc_per_node=8 train.py experiment=fot_pro_760m_48b data.path=...``,
``python train.py -m model=fot_pro,transformer_pro`` (one folder per job).

Configs live in ``configs/`` (Hydra); the training loop is :func:`fot.training.train`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parent


def argv_checks() -> ModuleType:
    """``fot/training/config.py`` loaded from its file, without ``import fot``.

    ``import fot`` imports torch and transformers (~7 s on a laptop CPU) to register the model
    classes; the command-line checks need only the standard library, omegaconf and Hydra, so a
    typo'd key gets its one-line answer in about half a second. The module is a separate copy
    (``_fot_argv_checks``) used for these checks only: the run itself uses
    ``fot.training.config``.
    """
    spec = importlib.util.spec_from_file_location(
        "_fot_argv_checks", ROOT / "fot" / "training" / "config.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and OmegaConf resolve annotations through it
    spec.loader.exec_module(module)
    return module


def argv_problem(argv: list[str]) -> str | None:
    """The first problem the command-line checks find in ``argv`` (train.py's arguments), or
    None. Hydra refuses an unknown key or group option without naming the right one: these say
    which field or option was meant, in the one-line form of the other errors."""
    checks = argv_checks()
    configs = ROOT / "configs"
    # options may also come from config folders added on the command line: Hydra checks those
    more_configs = any(
        a.lstrip("+").split("=")[0]
        in ("--config-dir", "-cd", "--config-path", "-cp", "hydra.searchpath")
        for a in argv
    )
    # an override Hydra cannot parse first: the checks below would misread it
    problems = [checks.unparsable_override(argv)]
    problems += [checks.unknown_override_key(arg, added=not more_configs) for arg in argv]
    problems.append(checks.mistyped_override(argv))  # a known key with a value of another type
    problems.append(checks.non_dict_override(argv))  # model.overrides=a:1 (or {a:1,b:2} unquoted)
    # +total_tokens=..., +experiment=..., model.overrides.x=... (Hydra: several lines, status 1)
    problems.append(checks.misprefixed_override(argv, None if more_configs else configs))
    if not more_configs:
        problems += [checks.unknown_group_option(arg, configs) for arg in argv]
    problems.append(checks.multirun_out_dir_problem(argv))  # before Hydra makes the sweep folder
    problems.append(checks.out_dir_problem(argv))  # before Hydra makes the run folder
    problems.append(checks.chdir_problem(argv))
    return next((problem for problem in problems if problem is not None), None)


def main(cfg: DictConfig) -> None:
    """Hydra's task (``hydra.main`` of the script): refuse one fixed out_dir for every job of
    a multirun, then train; errors that name the bad input and the fix print as one line
    (exit status 2), without a traceback, Ctrl-C says how to resume (exit status 130), and so
    does a stop on SIGTERM after its checkpoint (exit status 143)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from fot.errors import USER_ERRORS, error_line
    from fot.provenance import sweep_job_conflict
    from fot.training import train
    from fot.training.checkpoint import interrupted_message, write_text_atomic
    from fot.training.config import check_multirun_out_dir
    from fot.training.parallel import OtherRankGoneError, record_interrupted
    from fot.training.signals import EXIT_STATUS as SIGTERM_EXIT_STATUS
    from fot.training.signals import TrainingStopped

    STARTUP.job_begins()
    hydra_cfg = HydraConfig.get()
    hydra_files = {}
    if hydra_cfg.output_subdir is None:  # configs/train.yaml: written once the run owns its folder
        hydra_files = {
            "config.yaml": OmegaConf.to_yaml(cfg),  # as composed: out_dir not yet set
            "hydra.yaml": OmegaConf.to_yaml(HydraConfig.instance().cfg),
            "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
        }

    def owned(out_dir: Path) -> None:
        """The run owns its folder: Hydra's files go in, and train.log may say how it ends."""
        folder = Path(hydra_cfg.runtime.output_dir).absolute() / ".hydra"
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in hydra_files.items():
            write_text_atomic(folder / name, text)
        OWNS_FOLDER.append(out_dir)

    # a job of a multirun resumes by the sweep run again in its folder: -m refuses out_dir=...
    sweep = None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep = Path(hydra_cfg.sweep.dir).absolute()

    def interrupted() -> None:
        record_interrupted()  # for a rank left waiting, if Ctrl-C reached this process alone
        if int(os.environ.get("RANK", "0")) == 0:  # torchrun interrupts every rank
            out_dir = cfg.out_dir or hydra_cfg.runtime.output_dir
            if Path(out_dir).resolve() in OWNS_FOLDER:  # once this job owns its folder
                kept = interrupted_message(out_dir, cfg.resume, cfg.get("branch_from"), sweep)
            else:  # the folder goes again, or is left as it was found (the finally below)
                kept = "interrupted while starting; nothing was written"
            say(f"train.py: {kept}", blank=True)
        sys.exit(130)

    try:
        check_multirun_out_dir(cfg, multirun=hydra_cfg.mode == RunMode.MULTIRUN)
        if cfg.out_dir is None:
            cfg.out_dir = hydra_cfg.runtime.output_dir
        if sweep is not None:  # a rerun of the sweep with its values in another order
            job = hydra_cfg.runtime.output_dir
            task = list(hydra_cfg.overrides.task)
            hydra = HydraConfig.instance().cfg
            if conflict := sweep_job_conflict(
                task, sweep=sweep, job=job, run=cfg.out_dir, hydra=hydra, config=cfg
            ):
                raise ValueError(conflict)
        train(cfg, on_folder=owned)
    except TrainingStopped as stopped:
        if int(os.environ.get("RANK", "0")) == 0:
            say(f"train.py: {stopped.describe(sweep)}", blank=True)
        sys.exit(SIGTERM_EXIT_STATUS)
    except KeyboardInterrupt:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        interrupted()
    except USER_ERRORS as err:
        # These name the bad value and the fix (fot.errors): the message is what the user needs,
        # and a traceback above it only hides it (HYDRA_FULL_ERROR=1 shows it, as for Hydra's).
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # under torchrun each rank prints its own error (another rank's may differ): say whose
        prog = (
            f"train.py (rank {os.environ.get('RANK', '0')} of {world})" if world > 1 else "train.py"
        )
        if isinstance(err, OtherRankGoneError) and int(os.environ.get("RANK", "0")) == 0:
            # the rank that exited says nothing of it (Ctrl-C to that process alone): this names it
            out_dir = cfg.out_dir or hydra_cfg.runtime.output_dir
            kept = interrupted_message(
                out_dir, cfg.resume, cfg.get("branch_from"), sweep, event="the run stopped"
            )
            err = OtherRankGoneError(f"{err}; {kept}")
        say(error_line(prog, err, traceback_variable="HYDRA_FULL_ERROR"))
        sys.exit(2)
    except RuntimeError as err:
        # Ctrl-C inside a C++ writer (torch.save, safetensors) ends in the writer's RuntimeError
        if (
            not isinstance(err.__context__, KeyboardInterrupt)
            or os.environ.get("HYDRA_FULL_ERROR") == "1"
        ):
            log_file_only(logging.ERROR, f"train.py: stopped by\n{traceback.format_exc()}")
            raise
        interrupted()
    except Exception:
        log_file_only(logging.ERROR, f"train.py: stopped by\n{traceback.format_exc()}")
        raise


OWNS_FOLDER: list[Path] = []
"""The run folder, once the run owns it (until then train.log may be another run's)."""


def log_file_only(level: int, message: str) -> None:
    """Write ``message`` into the run's log files (Hydra's ``train.log``) but not the console,
    where it is printed, once the run owns its folder: a run folder then says why its run
    stopped."""
    if not OWNS_FOLDER:
        return
    record = logging.LogRecord("train.py", level, __file__, 0, message, None, None)
    for handler in logging.root.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def say(line: str, *, blank: bool = False) -> None:
    """Print ``line`` to stderr (after an empty line if ``blank``: below a progress bar) and
    into train.log."""
    print(("\n" if blank else "") + line, file=sys.stderr)
    log_file_only(logging.ERROR, line)


def remove_if_unused(folder: Path) -> None:
    """Remove the run folder that this process made for a run that was refused before it
    began: Hydra made it, with its ``train.log``, and the trainer's lock file went in; nothing
    else did. Kept if another run holds the lock.

    A multirun's sweep folder: each job folder in it that is so, then the sweep folder if
    nothing but Hydra's ``multirun.yaml`` is left (a job refused while starting, before any
    job trained). Job folders that hold anything else (``.hydra/``, checkpoints) are kept,
    and so is the sweep folder with them."""
    import fcntl

    names = {p.name for p in folder.iterdir()} if folder.is_dir() else {"?"}
    if "multirun.yaml" in names:
        for job in folder.iterdir():
            if job.is_dir() and not job.is_symlink():
                remove_if_unused(job)
        if {p.name for p in folder.iterdir()} == {"multirun.yaml"}:
            (folder / "multirun.yaml").unlink()
            folder.rmdir()
        return
    if not names <= {".run.lock", "train.log"}:
        return
    lock = folder / ".run.lock"
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return
        for name in names | {".run.lock"}:
            (folder / name).unlink(missing_ok=True)
    folder.rmdir()


def outermost_missing(folder: Path) -> Path | None:
    """The outermost of ``folder`` and its parents that does not exist (what ``mkdir -p``
    would make first); None where ``folder`` exists."""
    if folder.exists():
        return None
    while folder.parent != folder and not folder.parent.exists():
        folder = folder.parent
    return folder


def remove_made_parents(folder: Path, top: Path) -> None:
    """Remove the empty parents of the removed run folder ``folder`` up to ``top`` (included),
    the outermost folder made for the run: ``outputs/<date>/`` (``outputs/`` too in a fresh
    checkout) for a default folder, the missing parents of ``out_dir=a/b/run``. One that holds
    anything (another run's folder) stays, and so do those above it."""
    if folder.exists() or top not in folder.parents:
        return
    for parent in folder.parents:
        try:
            parent.rmdir()
        except OSError:  # not empty
            return
        if parent == top:
            return


def fresh_run_folder(argv: list[str], claimed: tuple[str, str, bool] | None) -> Path | None:
    """The folder a run (a multirun: its sweep folder) will use where this process makes it:
    the default folder made for it, or an ``out_dir=`` / ``hydra.run.dir=`` (a multirun:
    ``hydra.sweep.dir=``) that does not exist yet; None otherwise (rank > 0, a folder set in a
    config file or existing)."""
    if int(os.environ.get("RANK", "0") or 0) > 0:
        return None
    if claimed is not None:
        return None if claimed[2] else Path(claimed[1])
    folder = given_run_folder(argv)
    return None if folder is None or folder.exists() else folder


def given_run_folder(argv: list[str]) -> Path | None:
    """The folder of a run (a multirun: its sweep folder) that the command line names:
    ``hydra.run.dir=`` or ``out_dir=`` (a multirun: ``hydra.sweep.dir=``); None where it names
    none, or one that Hydra resolves (``${...}``)."""
    given = dict(a.lstrip("+").split("=", 1) for a in argv if "=" in a)
    if any(a in ("-m", "--multirun") for a in argv):
        value = given.get("hydra.sweep.dir")
    else:
        value = given.get("hydra.run.dir") or given.get("out_dir")
    if not value or value == "null" or "${" in value:
        return None
    return Path(value).expanduser()


def existing_run_folder(argv: list[str]) -> tuple[Path, frozenset[str]] | None:
    """The run folder (a multirun: sweep folder) that the command line names where it exists
    already, with the names in it before Hydra adds its files (rank 0 only; None otherwise):
    what :func:`remove_new_unused` may take out again."""
    if int(os.environ.get("RANK", "0") or 0) > 0:
        return None
    folder = given_run_folder(argv)
    if folder is None or not folder.is_dir() or folder.is_symlink():
        return None
    return folder, frozenset(p.name for p in folder.iterdir())


def remove_new_unused(folder: Path, before: frozenset[str], *, sweep: bool = False) -> None:
    """Take out of an existing run folder what Hydra put in for a run that was refused before
    it began (``before``: the names in it until then), so that the folder is left as it was
    found: Hydra's ``train.log`` while nothing is written in it and no other run holds the
    folder. A sweep folder (``sweep``, a multirun's): each new job folder that holds nothing else
    (:func:`remove_if_unused`), then ``multirun.yaml`` if it is new and no new job folder is
    left. Files that were there before stay (a ``multirun.yaml`` that Hydra rewrote too)."""
    from fot.training.checkpoint import RunFolderInUseError, RunFolderLock

    if not folder.is_dir():
        return
    new = {p.name for p in folder.iterdir()} - before
    if sweep:
        jobs = [folder / name for name in new if (folder / name).is_dir()]
        for job in jobs:
            if not job.is_symlink():
                remove_if_unused(job)
        if "multirun.yaml" in new and not any(job.exists() for job in jobs):
            (folder / "multirun.yaml").unlink(missing_ok=True)
        return
    log = folder / "train.log"
    if OWNS_FOLDER or "train.log" not in new or not log.is_file() or log.stat().st_size:
        return
    lock = RunFolderLock(folder)
    try:
        lock.take()
    except (RunFolderInUseError, OSError):  # another run holds the folder (or no write access)
        return
    try:
        with contextlib.suppress(OSError):  # gone or unreadable meanwhile: nothing to take out
            if not log.stat().st_size:
                log.unlink()
    finally:
        lock.discard()  # and its file, where take made it


def add_override(argv: list[str], override: str) -> None:
    """Put ``override`` into ``argv`` in front of the command line's first override (else at
    the end). Hydra's argparse reads the overrides as one run of words: one appended after a
    trailing flag (``python train.py seed=1 -m``) was refused as an unrecognized argument."""
    first = next((i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")), None)
    argv.insert(len(argv) if first is None else first, override)


def start(
    argv: list[str],
) -> tuple[
    tuple[str, str, bool] | None, Path | None, Path | None, tuple[Path, frozenset[str]] | None
]:
    """What comes before Hydra: the command-line checks, the imports (torch, transformers),
    srun's tasks, the run folder. Adds to ``argv`` (``sys.argv[1:]``) the overrides it needs
    (:func:`add_override`); returns the folder claimed for the run
    (:func:`claim_default_folder`), the one this process makes (:func:`fresh_run_folder`),
    the outermost folder made with it (that one or a parent; None where it existed:
    :func:`remove_made_parents`) and an existing folder named for the run, with what it held
    (:func:`existing_run_folder`). Exits with status 2 on a bad argument."""
    import datetime

    problem = argv_problem(argv)
    if problem is not None:
        print(f"train.py: error: {problem}", file=sys.stderr)
        sys.exit(2)
    from fot.errors import USER_ERRORS, error_line
    from fot.progress import quiet_library_bars
    from fot.training.config import (  # imports torch and transformers
        claim_default_folder,
        default_date_folder,
        register_configs,
        sweep_job_problem,
    )
    from fot.training.parallel import adopt_slurm_tasks

    try:
        adopt_slurm_tasks("train.py")  # `srun python train.py` with several tasks
    except USER_ERRORS as err:
        print(error_line("train.py", err, traceback_variable="HYDRA_FULL_ERROR"), file=sys.stderr)
        sys.exit(2)
    quiet_library_bars(int(os.environ.get("RANK", "0") or 0))
    register_configs()
    problem = sweep_job_problem(argv, ROOT / "configs")  # every job, before the first trains
    if problem is not None:
        print(f"train.py: error: {problem}", file=sys.stderr)
        sys.exit(2)
    # outputs/<date>/<time> made now, so that runs started in the same second get one each
    now = datetime.datetime.now()
    made_parent = outermost_missing(default_date_folder(argv, now))  # before it is made
    claimed = claim_default_folder(argv, now)
    if claimed is not None:
        add_override(argv, claimed[0])
    if int(os.environ.get("RANK", "0") or 0) > 0 and not any(
        a.lstrip("+").startswith("hydra/hydra_logging=") for a in argv
    ):
        # Hydra's own lines (a multirun's "Launching 2 jobs locally", "#0 : model=...") once,
        # from rank 0; its errors are printed without it
        add_override(argv, "hydra/hydra_logging=disabled")
    fresh = fresh_run_folder(argv, claimed)
    if fresh is None:
        return claimed, None, None, existing_run_folder(argv)
    made = made_parent if claimed is not None else outermost_missing(fresh)
    return claimed, fresh, made, None


class Startup:
    """Ctrl-C before a job's :func:`main` runs: the imports, the checks, Hydra composing the
    config (and, in a multirun, Hydra between two jobs). It prints one line and exits with
    status 130 (Python's default was a traceback and status 1).

    An interrupt does not always arrive as a :class:`KeyboardInterrupt`: one inside an import
    can leave a module half made and come out as the ``ImportError`` of the import after it,
    and a library may swallow it. So SIGINT is recorded here (:meth:`hold`) and whatever
    stops the process after it counts as the interrupt; one the startup swallowed stops it
    when the job begins. :meth:`job_begins` gives SIGINT back to Python's default handler,
    which the trainer's own Ctrl-C handling expects (``fot.training.signals``), and
    :meth:`job_ended` takes it again until the next job.
    """

    def __init__(self, multirun: bool) -> None:
        self.multirun = multirun
        self.signalled = False
        self.jobs_ended = 0

    def _handle(self, signum: int, frame: object) -> None:
        self.signalled = True
        raise KeyboardInterrupt

    def _ours(self) -> bool:
        return threading.current_thread() is threading.main_thread() and signal.getsignal(
            signal.SIGINT
        ) in (signal.default_int_handler, self._handle)

    def hold(self) -> None:
        """Record SIGINT (and raise :class:`KeyboardInterrupt`, as Python's handler does), in the
        main thread and where SIGINT has Python's default handler (not ``SIG_IGN``)."""
        if self._ours():
            signal.signal(signal.SIGINT, self._handle)

    def job_begins(self) -> None:
        """Start of :func:`main`: Python's default handler again; a swallowed interrupt stops
        the process here."""
        if self._ours():
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.signalled:
            self.stop()

    def job_ended(self) -> None:
        """End of :func:`main` (a multirun goes on to its next job)."""
        self.jobs_ended += 1
        self.hold()

    def interrupted(self, err: BaseException) -> bool:
        """Whether ``err`` (escaping before or between jobs) is, or comes from, Ctrl-C."""
        if isinstance(err, SystemExit):
            return False
        chained: BaseException | None = err
        while chained is not None:
            if isinstance(chained, KeyboardInterrupt):
                return True
            chained = chained.__cause__ or chained.__context__
        return self.signalled

    def stop(self) -> None:
        """Say what was interrupted and exit with status 130."""
        if self.jobs_ended == 0:
            line = "interrupted while starting; nothing was written"
        elif self.multirun:
            line = "interrupted between two jobs of the sweep: the jobs before it had ended"
        else:
            line = "interrupted after the run ended"
        print(f"\ntrain.py: {line}", file=sys.stderr)
        sys.exit(130)


STARTUP = Startup(multirun=any(a in ("-m", "--multirun") for a in sys.argv[1:]))


def run_hydra_app() -> None:
    """Hydra's entry point over :func:`main` (``configs/train.yaml``), with
    :meth:`Startup.job_ended` after each job."""
    import hydra

    def job(cfg: DictConfig) -> None:
        try:
            main(cfg)
        finally:
            STARTUP.job_ended()

    hydra.main(version_base="1.3", config_path="configs", config_name="train")(job)()


if __name__ == "__main__":
    args = sys.argv[1:]
    STARTUP.hold()
    try:
        claimed, fresh, made, existing = start(args)
    except BaseException as err:
        if not STARTUP.interrupted(err) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        STARTUP.stop()
    sys.argv[1:] = args
    try:
        if STARTUP.signalled:  # swallowed by a library while starting
            STARTUP.stop()
        run_hydra_app()
    except BaseException as err:
        if not STARTUP.interrupted(err) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        STARTUP.stop()
    finally:
        if claimed is not None and claimed[2]:  # another rank's: the run is in rank 0's folder
            shutil.rmtree(claimed[1], ignore_errors=True)
        if fresh is not None:  # a refused run (a sweep's refused job) leaves no folder behind
            remove_if_unused(fresh)
            if made is not None:
                remove_made_parents(fresh, made)
        if existing is not None:  # ... and an existing folder as it was
            remove_new_unused(*existing, sweep=STARTUP.multirun)
