"""Atomic, keep-last-k training checkpoints that resume bit-exactly.

A checkpoint is a folder ``<run>/checkpoints/step_<step:08d>/`` holding

    model.pt      full (unsharded) model state dict, fp32, FQN keys
    optim.pt      full optimizer state dict (FQN keys, so it loads under any strategy)
    rng.pt        the RNG states of every rank (torch, CUDA, numpy, python)
    trainer.json  step, tokens seen, data stream position, the resolved config

It is written into ``.tmp-step_<step>`` and renamed into place only when complete, so a crash
mid-save leaves the previous checkpoint the latest usable one (a stale temp folder is ignored
and cleaned up). Older checkpoints beyond ``keep_last`` are deleted after the rename (renamed
to ``.tmp-step_<step>.deleting`` first, so a delete cut short leaves nothing that looks
complete).
Checkpoints newer than the one a run resumes from belong to an abandoned run: they are renamed
to ``.abandoned-step_<step>`` (kept, but no longer picked by ``resume=auto`` nor counted by
``keep_last``).
Multi-node runs need the run folder on a shared file system.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fot.errors import FotError, cannot_write, retry_when
from fot.staging import ended_writers, remove, writer_tag
from fot.training.parallel import stop_together
from fot.training.signals import continue_hint, finish_before_ctrl_c

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
ABANDONED_PREFIX = ".abandoned-"
FAULT_ENV = "FOT_FAULT"
"""Test hook ``POINT:N`` (or ``POINT:N:RANK``, one rank only): ``kill_after_step:N`` or
``kill_in_checkpoint:N`` SIGKILLs the process (rank 0) after optimizer step N, or halfway
through writing the checkpoint of step N; ``sigterm_after_step:N`` (``sigint_after_step:N``)
sends it SIGTERM (SIGINT, as Ctrl-C) after step N (every rank, or RANK only)."""


def _fault(point: str, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, n, *rank = spec.split(":")
    if name != point or int(n) != step:
        return
    if rank and int(rank[0]) != int(os.environ.get("RANK", "0")):
        return
    import signal

    signals = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
    os.kill(os.getpid(), signals.get(point.split("_")[0], signal.SIGKILL))


def _dist() -> bool:
    """Whether a process group exists, so state must go through the collective path.

    This includes a group of one process (``parallel=fsdp`` without torchrun, whose group
    ``parallelize`` makes): its parameters are DTensors even though nothing is sharded, and only
    the ``torch.distributed.checkpoint`` path turns them into (and back from) plain full tensors.
    """
    return dist.is_initialized()


def _state_dict_options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def gather_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded model state on CPU (every rank must call it under DDP/FSDP)."""
    if not _dist():
        from fot.training.parallel import unwrap

        return {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_state_dict_options(cpu_offload=True))


def _torch_optimizers(optimizer: Any) -> Any:
    """The torch optimizer(s) behind ``optimizer``: itself, or the list a
    :class:`fot.training.optim.MuonAdamW` holds."""
    optimizers = getattr(optimizer, "optimizers", None)
    return list(optimizers) if optimizers is not None else optimizer


def gather_optim_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Full optimizer state keyed by parameter names (every rank must call it); of both
    optimizers of a :class:`fot.training.optim.MuonAdamW`."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    opts = _state_dict_options(cpu_offload=True) if _dist() else _state_dict_options()
    return get_optimizer_state_dict(model, _torch_optimizers(optimizer), options=opts)


def rng_state() -> dict[str, Any]:
    """This process' RNG states."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def written_whole(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write the file to: renamed over ``path`` when
    the block ends normally, removed otherwise, so a run stopped while writing (Ctrl-C,
    SIGTERM, a full disk) leaves the previous file (or none), never a cut-short one. The
    temporary name ``.{name}.{host}.{pid}.tmp{suffix}`` holds the host's name and the process
    id (:func:`fot.staging.writer_tag`), so ranks writing the same file do not write into each
    other's, and ends in ``path``'s suffix, so ``np.savez`` (which appends ``.npz`` to a name
    without it) and ``fig.savefig`` (which picks the format from it) write to it as given.
    A process killed while writing (SIGKILL, the OOM killer) leaves its temporary file: the
    next write of ``path`` removes those of processes that have ended (:mod:`fot.staging`),
    and logs one line naming them.

    Raises:
        fot.errors.WriteError: it could not be written (a full disk, a read-only folder)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{writer_tag()}.tmp{path.suffix}")
    gone = remove(ended_writers(path.parent, f".{path.name}.", f".tmp{path.suffix}"))
    if gone:
        logger.warning(
            "removed %s from %s: left by writes of %s that did not finish (%s)",
            ", ".join(left.path.name for left in gone),
            path.parent,
            path.name,
            "; ".join(left.writer() for left in gone),
        )
    existed = path.exists()
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:  # a full disk: no cut-short temporary file is left either
        tmp.unlink(missing_ok=True)
        kept = f"{path} is as it was" if existed else ""
        error = cannot_write(path, err, kept) if isinstance(err, Exception) else None
        if error is None:
            raise
        raise error from err


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` whole (:func:`written_whole`).

    Raises:
        fot.errors.WriteError: it could not be written (a full disk, a read-only folder)."""
    with written_whole(path) as tmp:
        tmp.write_text(text)


def _set_aside(ckpt: Path) -> Path:
    """Rename a checkpoint that is to be deleted to ``.tmp-step_N.deleting``: a delete cut short
    (a crash, an error) then leaves no ``step_N`` folder missing files that would count as
    complete; :func:`clean_stale` removes what is left."""
    trash = ckpt.with_name(f".tmp-{ckpt.name}.deleting")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(ckpt, trash)
    return trash


_MODEL_FOLDER = (
    "is a model's folder (config.json and weights: an export, a converted or downloaded "
    "checkpoint), not a training checkpoint (no trainer.json: no optimizer state, step or data "
    "position); a new run starts from its weights with init_from=<that folder>"
)


def not_a_checkpoint(path: str | os.PathLike) -> str:
    """What ``path`` is instead of a checkpoint folder, and the checkpoints beside it or in it:
    ``"... does not exist; that run's checkpoints are step_00000006, step_00000008 (only the
    last keep_last are kept)"``."""
    p = Path(path)
    if not p.exists():
        what = "does not exist"
    elif not p.is_dir():
        what = "is no folder"
    elif (p / "config.json").is_file():
        return f"{p} {_MODEL_FOLDER}"
    else:
        what = "is not a training checkpoint (no trainer.json)"
    inside, beside = list_checkpoints(p / "checkpoints"), list_checkpoints(p.parent)
    if inside:
        return f"{p} {what}: it is a run folder; pass one of its checkpoints, e.g. {inside[-1]}"
    if beside:
        names = ", ".join(c.name for c in beside)
        return f"{p} {what}; that run's checkpoints are {names} (only the last keep_last are kept)"
    return f"{p} {what}; pass a checkpoint folder like <run>/checkpoints/step_00001000"


CHECKPOINT_FILES = ("model.pt", "optim.pt", "rng.pt", "trainer.json")
"""The files of a complete checkpoint folder (module docstring)."""


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``ckpt_dir``, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "trainer.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or ``None``."""
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def interrupted_message(
    out_dir: str | os.PathLike,
    resume: str | None = None,
    branch_from: str | None = None,
    sweep: str | os.PathLike | None = None,
    event: str = "interrupted",
) -> str:
    """What a run stopped by Ctrl-C (or SIGINT) has kept, and the command line that resumes it
    (:func:`continue_hint`; ``resume`` and ``branch_from`` are the run's settings, ``sweep``
    the sweep folder of a multirun job); ``event`` starts the message (e.g. ``"the run
    stopped"`` where another process ended it)."""
    out = Path(out_dir)
    latest = latest_checkpoint(out / "checkpoints")
    if latest is None:
        again = f"from branch_from={branch_from}" if branch_from else "over"
        return (
            f"{event} before the first checkpoint of {out}: nothing to resume from, a rerun "
            f"starts {again} (ckpt_every_tokens sets how often checkpoints are written)"
        )
    hint = continue_hint(out, resume, sweep)
    return f"{event}; the latest checkpoint is {latest} (later steps are lost): {hint}"


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep_last: int,
    is_main: bool,
) -> Path:
    """Write a checkpoint atomically (all ranks call this; rank 0 writes). Ctrl-C while it is
    written stops the run once it is complete (:func:`fot.training.signals.finish_before_ctrl_c`).

    Args:
        ckpt_dir: the run's ``checkpoints`` folder.
        step: optimizer steps done; names the folder.
        model: the trained (possibly wrapped/sharded) model.
        optimizer: its optimizer.
        trainer_state: JSON-serialisable state (step, tokens, data position, config).
        keep_last: complete checkpoints to keep (>= 1).
        is_main: whether this is rank 0.

    Returns:
        The checkpoint folder.
    """
    root = Path(ckpt_dir)
    final = root / f"step_{step:08d}"
    with finish_before_ctrl_c(f"the checkpoint of step {step}", announce=is_main):
        model_state = gather_model_state(model)
        optim_state = gather_optim_state(model, optimizer)
        rng = rng_state()
        if _dist():
            rngs: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        # rank 0 writes; a failure there stops every rank with its error at once (the others
        # would wait for it in the next collective)
        with stop_together(f"while writing the checkpoint of step {step}"):
            if is_main:
                root.mkdir(parents=True, exist_ok=True)
                tmp = root / f".tmp-step_{step:08d}"
                writing = tmp
                try:
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir()
                    _save(model_state, writing := tmp / "model.pt")
                    _fault("kill_in_checkpoint", step)
                    _save(optim_state, writing := tmp / "optim.pt")
                    _save(rngs, writing := tmp / "rng.pt")
                    with open(writing := tmp / "trainer.json", "w") as f:
                        json.dump(trainer_state, f, indent=2)
                        f.flush()
                        os.fsync(f.fileno())
                    _fsync_dir(tmp)
                except Exception as err:
                    # a full disk, a quota, a read-only folder: free what the cut-short checkpoint
                    # took and say so in one line (torch.save's own error, "unexpected pos 704 vs
                    # 598", names neither the file nor the cause)
                    shutil.rmtree(tmp, ignore_errors=True)
                    error = cannot_write(writing, err, _kept_message(root, step, err))
                    if error is None:
                        raise
                    raise error from err
                replaced = None
                if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
                    replaced = _set_aside(final)
                os.rename(tmp, final)
                _fsync_dir(root)
                if replaced is not None:
                    shutil.rmtree(replaced, ignore_errors=True)
                for old in list_checkpoints(root)[: -max(keep_last, 1)]:
                    shutil.rmtree(_set_aside(old), ignore_errors=True)
    return final


def _kept_message(root: Path, step: int, err: BaseException) -> str:
    """What a failed save of step ``step`` kept: the complete checkpoints, and how to go on,
    fitting the cause ``err`` (a full disk: once there is room; a read-only file system or no
    permission: in another folder from the latest checkpoint, or once it is writable)."""
    latest = latest_checkpoint(root)
    if latest is None:
        return f"The checkpoint of step {step} was not written, and the run has no earlier one"
    when, elsewhere = retry_when(err)
    kept = (
        f"The checkpoint of step {step} was not written; the earlier ones are complete (the "
        f"latest is {latest}): "
    )
    if elsewhere:
        return kept + (
            f"rerun with out_dir=<a folder you can write> resume={latest} to go on from it "
            f"there, or, {when}, with resume=auto and out_dir={root.parent}"
        )
    return kept + f"{when}, rerun with resume=auto and out_dir={root.parent} to go on from it"


def abandon_newer(
    ckpt_dir: str | os.PathLike, step: int, *, keep: str | os.PathLike | None = None
) -> list[Path]:
    """Move checkpoints of steps after ``step`` aside (rank 0, when a run starts at ``step``).

    They belong to an abandoned run (this run resumed from an earlier checkpoint, or started
    over): left in place, ``keep_last`` would delete the checkpoints this run writes instead of
    them and ``resume=auto`` would pick them. Each ``step_N`` is renamed to
    ``.abandoned-step_N`` (``.abandoned-step_N.1``, ... if that exists), which
    :func:`list_checkpoints` and :func:`clean_stale` ignore; nothing is deleted.

    Args:
        ckpt_dir: the run's ``checkpoints`` folder.
        step: the step the run starts at (0 without resume).
        keep: the checkpoint resumed from; never moved.

    Returns:
        The new paths of the moved checkpoints, oldest first.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    kept = Path(keep).resolve() if keep is not None else None
    moved = []
    for p in sorted(root.iterdir()):
        m = _STEP_DIR.match(p.name)
        if not (m and p.is_dir() and int(m.group(1)) > step) or p.resolve() == kept:
            continue
        dest = unused_path(root / f"{ABANDONED_PREFIX}{p.name}")
        os.rename(p, dest)
        moved.append(dest)
    if moved:
        _fsync_dir(root)
    return moved


def unused_path(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ... : the first that does not exist."""
    dest, n = path, 0
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.{n}")
    return dest


def clean_stale(ckpt_dir: str | os.PathLike) -> None:
    """Remove half-written folders left by a crash (rank 0, before training, with the run
    folder locked): ``.tmp-*`` checkpoints, and the final export's ``.hf.new-*`` (written
    beside ``hf/``, or inside an existing ``hf/``, and moved into it once complete,
    :func:`fot.export.export_hf`).

    ``.abandoned-*`` folders (see :func:`abandon_newer`) are complete checkpoints: kept.
    """
    root = Path(ckpt_dir)
    exports = [*root.parent.glob(".hf.new-*"), *root.parent.glob("hf/.hf.new-*")]
    for p in [*root.glob(".tmp-step_*"), *exports]:
        shutil.rmtree(p, ignore_errors=True)


RUN_LOCK = ".run.lock"
"""The file in a run folder that :class:`RunFolderLock` locks."""


class RunFolderInUseError(FotError, RuntimeError):
    """Another run is using the folder: training in it, or evaluating into it (`fot.eval --out`)."""


class RunFolderLock:
    """An exclusive lock on a run folder, held by rank 0 while a run trains in it.

    Two runs in one folder (the same ``out_dir``, or the same ``hydra.run.dir``) would write
    each other's checkpoints, metrics and ``final.json``. The second one is refused instead, naming the first.
    The lock is ``flock`` on :data:`RUN_LOCK` (which records the holder's process id, host and
    start time), so a run that dies releases it; on a file system without ``flock`` (some network
    mounts) there is no lock. The file stays behind: removing it could let two runs lock it.
    ``fot.eval`` locks each command's ``--out`` with it (:func:`fot.eval.common.lock_out`).

    Args:
        out_dir: the run folder.
        option: the option that names the folder, for the fix (``fot.eval``: ``--out``).
        why: why two runs may not share it.
        after: the other way out, besides another folder.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        option: str = "out_dir=...",
        why: str = "two runs in one folder would mix their checkpoints and metrics",
        after: str = "wait for that run to end",
    ) -> None:
        self.path = Path(out_dir) / RUN_LOCK
        self._option, self._why, self._after = option, why, after
        self._file: Any = None
        self.made = False
        """Whether :meth:`take` made the lock file (the folder had none)."""

    def take(self) -> None:
        """Take the lock if the folder exists and it is not held yet (a no-op otherwise).

        Raises:
            RunFolderInUseError: another process holds it; the message names it and the fix.
            WriteError: the lock file cannot be opened for writing (a read-only folder, no
                permission, a folder of that name).
        """
        import fcntl
        import socket
        import time

        if self._file is not None or not self.path.parent.is_dir():
            return
        while True:
            made = not self.path.exists()
            try:
                f = open(self.path, "a+")  # noqa: SIM115 - held open while the run trains
            except OSError as err:
                kept = f"It keeps a second run out of this folder: pass another {self._option}"
                raise cannot_write(self.path, err, kept) or err from err
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "a process that recorded nothing"
                f.close()
                raise RunFolderInUseError(
                    f"{self.path.parent} is in use by another run ({holder}): {self._why}. "
                    f"Pass another {self._option}, or {self._after}"
                ) from None
            except OSError:  # no flock on this file system: no lock, and no file made for one
                f.close()
                if made:
                    self.path.unlink(missing_ok=True)
                return
            if _same_file(f, self.path):
                break
            # A run that held the lock removed its file (discard) between our open and our
            # flock: the lock taken is on a file no other run will open. Open the path again.
            f.close()
        f.seek(0)
        f.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        f.flush()
        self._file = f
        self.made = made

    def release(self) -> None:
        """Let the lock go (the run ended, or failed)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def discard(self) -> None:
        """Let the lock go and remove the lock file if :meth:`take` made it (while it is
        held): a run refused before it began leaves the folder as it found it."""
        if self._file is not None and self.made:
            self.path.unlink(missing_ok=True)
        self.release()


def _same_file(f: Any, path: Path) -> bool:
    """Whether the open file ``f`` is the file now at ``path`` (not one removed since)."""
    try:
        now = path.stat()
    except OSError:
        return False
    opened = os.fstat(f.fileno())
    return (opened.st_dev, opened.st_ino) == (now.st_dev, now.st_ino)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from ``path``; return the trainer state.

    Every rank reads the full state (the folder must be visible to all ranks) and loads it into
    its own (possibly sharded) model.
    """
    p = Path(path)
    state = read_trainer_state(p)
    model_state = read_model_state(p)
    optim_state = _load_file(p, "optim.pt", weights_only=False)
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fot.training.parallel import unwrap

    # trainer.json's config matched this run (check_resume), so tensors that do not fit the
    # model mean that files of another run were copied into the folder: not a traceback
    name = "model.pt"
    try:
        if _dist():
            set_model_state_dict(model, model_state, options=_state_dict_options())
        else:
            unwrap(model).load_state_dict(model_state)
        name = "optim.pt"
        # The checkpoint gives the moments and step counts; the hyperparameters (betas, eps,
        # weight decay) and implementation flags (fused, capturable for CUDA graphs) are this
        # run's config's: loading would otherwise replace them with the saving run's, and the
        # flags also decide where the step counts are put while loading.
        for saved, own in zip(optim_state["param_groups"], optimizer.param_groups, strict=True):
            saved.update({k: v for k, v in own.items() if k != "params"})
        set_optimizer_state_dict(
            model, _torch_optimizers(optimizer), optim_state, options=_state_dict_options()
        )
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        text = str(e)
        if name == "model.pt" and "size mismatch for " in text and "key(s)" not in text:
            # the same weights in other shapes: an older fot's model, or another run's files
            first = text.split("size mismatch for ", 1)[1].split("\n", 1)[0].strip()
            what = (
                f"checkpoint {p}: model.pt holds weights of other shapes than the model this "
                f"config builds (size mismatch for {first})"
            )
            raise CorruptCheckpointError(
                f"{what}. Either an older fot wrote it, whose model differed (Samba's MLPs after "
                "Mamba layers were FLA's width 4 before mamba_hidden_ratio): keep it, and resume "
                "it with that version or start a new run in another out_dir; or another run's "
                f"files were copied into it: {_ways_out(p)}",
                what,
            ) from e
        if name == "optim.pt" and (changed := _changed_groups(model, optimizer, optim_state)):
            samba = (
                "; a newer fot keeps what FLA marks _no_weight_decay, e.g. Samba's A_log, out "
                "of optim=muon"
                if "A_log" in changed
                else ""
            )
            raise OptimizerGroupsChangedError(
                f"checkpoint {p}: the optimizer's parameter groups changed since the checkpoint "
                f"was written ({changed}{samba}), so optim.pt holds no state for them in the "
                "optimizer that steps them now; its files are intact and were not changed. "
                "Resume with the fot that wrote the checkpoint (the git_sha in "
                f"{p.parent.parent / 'run_info.json'}), or start a new run from its weights in "
                f"another out_dir with init_from={p} (step, optimizer state and data position "
                "start from zero)"
            ) from e
        raise CorruptCheckpointError(*_corrupt_message(p, p / name, e)) from e
    rngs = _load_file(p, "rng.pt", weights_only=False)
    set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
    return state


class OptimizerGroupsChangedError(FotError, RuntimeError):
    """A checkpoint's optimizer state assigns parameters to other optimizers or parameter
    groups than this run's optimizer does (a newer fot grouped them otherwise)."""


def _changed_groups(model: nn.Module, optimizer: Any, optim_state: dict[str, Any]) -> str | None:
    """How the parameter groups of ``optim_state`` (a checkpoint's ``optim.pt``) differ from
    ``optimizer``'s, as "A_log in Muon's groups then, AdamW's now"; None where they agree (or
    the state names parameters this model lacks: then the files are not this run's)."""
    try:  # the names torch's get_optimizer_state_dict keys the state by (a private helper)
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:  # another torch: the load's own error stands
        return None
    try:
        saved_groups = [list(g["params"]) for g in optim_state["param_groups"]]
    except (KeyError, TypeError):
        return None
    fqn = {id(param): next(iter(_get_fqns(model, n))) for n, param in model.named_parameters()}
    owners = [
        (type(opt).__name__, [[fqn.get(id(q)) for q in g["params"]] for g in opt.param_groups])
        for opt in _as_list(_torch_optimizers(optimizer))
    ]
    now_groups = [group for _, groups in owners for group in groups]
    if {n for g in saved_groups for n in g} != {n for g in now_groups for n in g}:
        return None  # other parameters: another model's files
    if len(saved_groups) != len(now_groups):
        return f"{len(saved_groups)} parameter groups then, {len(now_groups)} now"
    owner_now = {n: (o, i) for o, groups in owners for i, g in enumerate(groups) for n in g}
    # the checkpoint's groups, in order, belong to the optimizers as this run's do
    index, owner_then = 0, {}
    for o, groups in owners:
        for i in range(len(groups)):
            owner_then.update({n: (o, i) for n in saved_groups[index]})
            index += 1
    moved = [n for n in owner_now if owner_then[n][0] != owner_now[n][0]]
    if not moved:
        return None  # between groups of one optimizer: torch moves the moments by name
    first = moved[0]
    more = f" and {len(moved) - 1} more" if len(moved) > 1 else ""
    return f"{first}{more} in {owner_then[first][0]}'s groups then, {owner_now[first][0]}'s now"


def _as_list(optimizers: Any) -> list[Any]:
    return optimizers if isinstance(optimizers, list) else [optimizers]


def read_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full float32 model state dict of checkpoint ``path`` (``model.pt``), on the CPU.

    Raises:
        CorruptCheckpointError: the file cannot be read (names the checkpoint and what to do).
    """
    return _load_file(Path(path), "model.pt", weights_only=True)


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """The trainer state saved with a checkpoint (``trainer.json``: step, tokens, data
    position, sizes and the run's resolved config), without loading any tensor."""
    p = Path(path)
    if not (p / "trainer.json").is_file() and (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} {_MODEL_FOLDER}")
    if not (p / "trainer.json").is_file():
        raise FileNotFoundError(
            f"{p} is not a complete checkpoint (no trainer.json); pass a folder like "
            "<run>/checkpoints/step_00001000, or resume=auto to pick the latest"
        )
    state = _load_file(p, "trainer.json")
    missing = [
        k
        for k in ("step", "tokens", "data", "sizes")
        if not isinstance(state, dict) or k not in state
    ]
    if missing:
        error = KeyError(f"no {', '.join(missing)} in it")
        raise CorruptCheckpointError(*_corrupt_message(p, p / "trainer.json", error))
    return state


class CorruptCheckpointError(FotError, RuntimeError):
    """A file of a checkpoint cannot be read (truncated, corrupt or missing).

    Attributes:
        what: the message without the ways out (which checkpoint, which file, the error), for
            a caller that suggests other ones.
    """

    def __init__(self, message: str, what: str | None = None) -> None:
        super().__init__(message)
        self.what = what or message


def check_model_file(path: str | os.PathLike) -> None:
    """Open checkpoint ``path``'s ``model.pt`` without reading its tensors (its zip directory,
    memory-mapped): a file cut short is refused in moments.

    Raises:
        CorruptCheckpointError: the file cannot be opened (names the checkpoint and what to do).
    """
    _load_file(Path(path), "model.pt", weights_only=True, mmap=True)


def _load_file(ckpt: Path, name: str, *, weights_only: bool = False, mmap: bool = False) -> Any:
    """Read ``ckpt/name``; a file that cannot be read names the checkpoint and what to do."""
    path = ckpt / name
    try:
        if name.endswith(".json"):
            with open(path) as f:
                return json.load(f)
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except Exception as e:
        raise CorruptCheckpointError(*_corrupt_message(ckpt, path, e)) from e


def _corrupt_message(ckpt: Path, path: Path, error: Exception) -> tuple[str, str]:
    """The message of a checkpoint file that cannot be read, and its part without the ways out
    (:class:`CorruptCheckpointError`'s arguments)."""
    detail = str(error).rstrip(".") if len(str(error)) <= 400 else f"{str(error)[:400]}..."
    what = (
        f"checkpoint {ckpt} is corrupt or incomplete: cannot read {path.name} "
        f"({path}): {type(error).__name__}: {detail}"
    )
    return f"{what}. {_ways_out(ckpt)}", what


def _ways_out(ckpt: Path) -> str:
    """What to do about an unusable checkpoint ``ckpt``: an earlier one, or starting over."""
    m = _STEP_DIR.match(ckpt.name)
    step = int(m.group(1)) if m else None
    earlier = [
        c
        for c in list_checkpoints(ckpt.parent)
        if step is not None and int(c.name.split("_")[1]) < step
    ]
    if earlier:
        options = (
            f"resume from an earlier checkpoint with resume=<path>, e.g. resume={earlier[-1]} "
            f"(earlier checkpoints there: {', '.join(c.name for c in earlier)})"
        )
    else:
        options = "start over with resume=never (no earlier checkpoint in that folder)"
    return (
        f"Either {options}, or delete or move {ckpt} away and rerun with resume=auto to use "
        "the newest remaining one"
    )
