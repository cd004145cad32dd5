"""Stop a training run on SIGTERM with a checkpoint of the step it was in.

Slurm (at the time limit, or earlier with ``#SBATCH --signal=TERM@120``), Kubernetes,
Docker, ``timeout`` and torchrun (which passes its own SIGTERM on to every worker) ask a
process to stop with SIGTERM and kill it some seconds later. By default Python dies at once
and the steps since the last checkpoint are lost. With :class:`StopOnSigterm` installed the
signal only sets a flag; the trainer asks :meth:`StopOnSigterm.agreed` after every step (and
before every micro batch of a validation, which then ends early), and once it says yes every
rank writes a checkpoint of that same step and the run ends with
:class:`TrainingStopped` (``train.py`` then exits with status 143, as a process killed by
SIGTERM does, and says how to resume). Further SIGTERMs change nothing: a rank may get two
(e.g. the scheduler's and torchrun's). Ctrl-C (SIGINT) and SIGKILL still stop at once, except
that Ctrl-C while a checkpoint is written lets it finish first (:func:`finish_before_ctrl_c`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from fot.training.parallel import group_timeout

EXIT_STATUS = 128 + signal.SIGTERM
"""``train.py``'s exit status after a stop on SIGTERM (that of a process SIGTERM killed)."""


def continue_hint(
    out_dir: str | os.PathLike, resume: str | None = None, sweep: str | os.PathLike | None = None
) -> str:
    """The command line that continues the run in ``out_dir`` from its latest checkpoint.

    The folder must be named (``out_dir=...``): without it ``train.py`` starts a new
    timestamped folder. A job of a multirun names its sweep folder instead: ``-m`` refuses one
    ``out_dir`` for every job, and the sweep run again in its folder continues the stopped job
    and runs the jobs it did not reach (a finished job does nothing). A run started with
    ``resume=<checkpoint>`` or ``resume=never`` must not be rerun as it was: that would start
    over from the checkpoint (or from scratch) and move the newer checkpoints aside.

    Args:
        out_dir: the run folder.
        resume: the run's ``resume`` setting.
        sweep: the sweep folder (``hydra.sweep.dir``) when the run is a job of a multirun.
    """
    if sweep is not None:
        where = f"hydra.sweep.dir={sweep}"
        what = "to continue this job and then run the sweep's remaining ones (finished jobs "
        what += "are not trained again)"
    else:
        where, what = f"out_dir={out_dir}", "to continue from it"
    if resume in (None, "", "auto"):
        return f"run the same command with {where} {what} (resume=auto)"
    return (
        f"run the same command with {where} and resume=auto in place of "
        f"resume={resume} {what} (as it is, the command would start over "
        f"{'from scratch' if resume == 'never' else 'from that checkpoint'})"
    )


class TrainingStopped(Exception):
    """The run stopped on SIGTERM after writing a checkpoint of its last step.

    Attributes:
        step: optimizer steps done.
        checkpoint: the checkpoint folder of that step.
    """

    def __init__(
        self, step: int, checkpoint: Path, out_dir: Path, resume: str | None = None
    ) -> None:
        self.step = step
        self.checkpoint = checkpoint
        self.out_dir = out_dir
        self.resume = resume
        super().__init__(self.describe())

    def describe(self, sweep: str | os.PathLike | None = None) -> str:
        """What was kept and how to continue; ``sweep``: the sweep folder of a multirun job,
        which the trainer that raised this does not know (:func:`continue_hint`)."""
        return (
            f"stopped by SIGTERM after step {self.step}; its checkpoint is {self.checkpoint}: "
            + continue_hint(self.out_dir, self.resume, sweep)
        )


class StopOnSigterm:
    """A SIGTERM handler that asks the training loop to stop at the next step boundary.

    Use as a context manager around the loop (the previous handler is put back on exit); call
    :meth:`agreed` on every rank at the same points (after every step). Outside the main
    thread (where Python cannot install signal handlers), or where SIGTERM is ignored
    (``SIG_IGN``), it installs nothing and this process's flag stays false.

    Python runs the handler only when the main thread runs Python code. A process waiting in
    a collective for a rank that has died (torchrun then sends SIGTERM to the others) never
    does, and would sit there until the launcher's SIGKILL (``torchrun --shutdown-timeout``).
    A watcher thread therefore ends the process (status 143, no checkpoint) when the handler
    has not run :attr:`stuck_after_s` seconds after a SIGTERM came.

    Args:
        world_size: processes in the run. With more than one, :meth:`agreed` takes the
            maximum of every rank's flag over a gloo group (host memory, no GPU sync), so all
            ranks stop after the same step even if the signal reached only some of them.
    """

    stuck_after_s = 60.0
    """Seconds after a SIGTERM within which the main thread must have run the handler."""

    def __init__(self, world_size: int) -> None:
        self.signalled = False
        self._handled = threading.Event()
        self._previous: signal.Handlers | object | None = None
        self._installed = False
        self._wakeup: tuple[int, int] | None = None  # (read end, write end) of the watcher's pipe
        self._watcher: threading.Thread | None = None
        self._group: dist.ProcessGroup | None = None
        self._collective = world_size > 1 and dist.is_initialized()
        if self._collective and dist.get_backend() != "gloo":
            # collective: every rank makes it; a new group's timeout is torch's default unless
            # given, so it gets the run's (parallel.timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=group_timeout())

    def __enter__(self) -> StopOnSigterm:
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
            self._start_watcher()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._installed = False
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            os.close(self._wakeup[1])  # the watcher reads the end of the pipe and returns
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            self._wakeup = self._watcher = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True
        self._handled.set()

    def _start_watcher(self) -> None:
        """Have the signal's number written to a pipe the moment it comes (Python's wakeup fd),
        for a thread that checks the main thread handles it in time; not where the wakeup fd
        is in use already (an asyncio loop in the main thread)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:  # someone else's: put it back, no watcher
            signal.set_wakeup_fd(previous)
            os.close(read), os.close(write)
            return
        self._wakeup = (read, write)
        self._watcher = threading.Thread(target=self._watch, name="sigterm-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        assert self._wakeup is not None
        read = self._wakeup[0]
        try:
            while data := os.read(read, 64):
                if signal.SIGTERM not in data or self._handled.is_set():
                    continue
                if not self._handled.wait(self.stuck_after_s):
                    rank = os.environ.get("RANK", "0")
                    os.write(
                        2,
                        f"\nrank {rank}: SIGTERM came while this process was waiting outside "
                        f"Python (in a collective or on the GPU) and it still was "
                        f"{self.stuck_after_s:g} s later: another process of the run has "
                        "probably died. Stopping now, without a checkpoint; resume=auto, with "
                        "this run's out_dir, continues from the latest one\n".encode(),
                    )
                    os._exit(EXIT_STATUS)
        finally:
            os.close(read)

    def agreed(self) -> bool:
        """Whether any rank has had SIGTERM; every rank must call this after the same step."""
        if not self._collective:
            return self.signalled
        flag = torch.tensor([int(self.signalled)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


@contextlib.contextmanager
def finish_before_ctrl_c(what: str, *, announce: bool) -> Iterator[None]:
    """Ctrl-C (SIGINT) inside the block lets the block finish, then raises
    :class:`KeyboardInterrupt`; a second Ctrl-C raises it at once.

    Around a checkpoint's write: interrupted inside ``torch.save``, torch ends in a
    ``RuntimeError`` of its zip writer and leaves half a checkpoint; finished, the run stops
    with the checkpoint of that step complete. Outside the main thread, or where SIGINT has a
    handler other than Python's default, nothing changes.

    Args:
        what: what is being finished, for the line printed on the first Ctrl-C.
        announce: print that line (rank 0); every rank defers alike.
    """
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pending: list[bool] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(True)
        if announce:
            print(
                f"\nCtrl-C: finishing {what} first (Ctrl-C again stops at once, leaving it "
                "unfinished)",
                file=sys.stderr,
                flush=True,
            )

    signal.signal(signal.SIGINT, handle)
    try:
        yield
    except RuntimeError:
        if pending:  # torch's writer, stopped by the second Ctrl-C
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt
