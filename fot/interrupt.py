"""Stop a command on SIGTERM as Ctrl-C stops it (``fot.eval``, ``fot.data.prepare``).

Slurm (at the time limit), ``timeout``, Docker and torchrun stop a process with SIGTERM and
kill it some seconds later; Python's default is to die at once, skipping what a command does
on Ctrl-C (keep finished results, remove temporary folders). Inside :class:`StopOnSignal` the
signal raises ``KeyboardInterrupt`` (or a subclass) where the process is, once: further signals
are ignored, so that they do not cut into the clean-up the first one started.

A raise that lands inside a ``__del__`` (a tokenizer's regex objects have one) is only printed
by Python, and the command would go on; so loops call :func:`check_stop` (or iterate through
:meth:`StopOnSignal.checked`) between items, which raises again once a signal has come.
(``train.py`` stops differently: every rank finishes its step and checkpoints it,
``fot.training.signals``.)
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

_T = TypeVar("_T")
_ACTIVE: list[StopOnSignal] = []


class StopOnSignal:
    """Context manager: the given signals raise ``error`` once, where the process is.

    Handlers are installed only in the main thread (the only one Python lets) and not over a
    signal that is ignored (``SIG_IGN``, e.g. SIGINT of a background job); the previous
    handlers come back on exit.

    Args:
        signals: the signals to handle.
        error: the exception raised (``KeyboardInterrupt`` or a subclass, so that ``finally``
            and ``except KeyboardInterrupt`` blocks run as on Ctrl-C).

    Attributes:
        signum: the first signal received, or None.
    """

    def __init__(
        self,
        signals: Iterable[int] = (signal.SIGTERM,),
        error: type[BaseException] = KeyboardInterrupt,
    ) -> None:
        self.signals = tuple(signals)
        self.error = error
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._held = 0

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            return  # a second signal must not cut into the clean-up that the first started
        self.signum = signum
        if not self._held:
            raise self.error

    def check(self) -> None:
        """Raise ``error`` if a signal has come (again, where its first raise was lost)."""
        if self.signum is not None:
            raise self.error

    def checked(self, items: Iterable[_T]) -> Iterator[_T]:
        """``items``, calling :meth:`check` before each one and at the end."""
        for item in items:
            self.check()
            yield item
        self.check()


def check_stop() -> None:
    """Raise the interruption of every active :class:`StopOnSignal` whose signal has come.

    Call it between items of a loop that is not inside a ``finally`` or ``except`` block (it
    must not run while the first raise unwinds)."""
    for stop in _ACTIVE:
        stop.check()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Inside, a signal of an active :class:`StopOnSignal` is noted (``signum``) but raises
    nothing: for a step that must not stop halfway, such as moving new folders into place
    (:func:`fot.data.tokens.replace_folders`). After it, :meth:`StopOnSignal.check` raises
    for a signal that came; a step that completed the job may leave it unraised."""
    held = list(_ACTIVE)
    for stop in held:
        stop._held += 1
    try:
        yield
    finally:
        for stop in held:
            stop._held -= 1


__all__ = ["StopOnSignal", "check_stop", "signals_held"]
