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
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

EXIT_STATUS = 128 + signal.SIGTERM
"""``train.py``'s exit status after a stop on SIGTERM (that of a process SIGTERM killed)."""


class TrainingStopped(Exception):
    """The run stopped on SIGTERM after writing a checkpoint of its last step.

    Attributes:
        step: optimizer steps done.
        checkpoint: the checkpoint folder of that step.
    """

    def __init__(self, step: int, checkpoint: Path, out_dir: Path) -> None:
        self.step = step
        self.checkpoint = checkpoint
        self.out_dir = out_dir
        super().__init__(
            f"stopped by SIGTERM after step {step}; its checkpoint is {checkpoint}: run the "
            f"same command with out_dir={out_dir} to continue from it (resume=auto)"
        )


class StopOnSigterm:
    """A SIGTERM handler that asks the training loop to stop at the next step boundary.

    Use as a context manager around the loop (the previous handler is put back on exit); call
    :meth:`agreed` on every rank at the same points (after every step). Outside the main thread (where Python cannot
    install signal handlers), or where SIGTERM is ignored (``SIG_IGN``), it installs nothing
    and this process's flag stays false.

    Args:
        world_size: processes in the run. With more than one, :meth:`agreed` takes the
            maximum of every rank's flag over a gloo group (host memory, no GPU sync), so all
            ranks stop after the same step even if the signal reached only some of them.
    """

    def __init__(self, world_size: int) -> None:
        self.signalled = False
        self._previous: signal.Handlers | object | None = None
        self._installed = False
        self._group: dist.ProcessGroup | None = None
        self._collective = world_size > 1 and dist.is_initialized()
        if self._collective and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # collective: every rank makes it

    def __enter__(self) -> StopOnSigterm:
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

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
