"""Errors that name a bad input and the fix, and how the command lines print them.

``train.py`` and ``python -m fot.eval`` print these as one ``error:`` line (exit status 2)
instead of a traceback: the message says what to change, and a traceback above it only hides
it. Only errors raised by fot's own code count as such: a ``ValueError`` raised inside
another library (torch, transformers, datasets) may be a bug, so its one line also says
where it was raised, and the environment variable the command names brings the traceback back.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import traceback
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path


class FotError(Exception):
    """Base of fot's own error classes: each names the bad input (config, data, file) and the fix.

    Subclasses also derive from the built-in error they refine (``ValueError``,
    ``RuntimeError``, ...), so ``except ValueError`` keeps working for them.
    """


class MissingPackageError(FotError, ImportError):
    """A package that reading an input needs (a URL's filesystem, such as gcsfs) is missing."""


# Built-in errors that fot raises for a bad config, bad data, a missing or existing file or an
# unreachable hub; with :class:`FotError` these are what the command lines print as one line.
USER_ERRORS: tuple[type[BaseException], ...] = (
    FotError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    ConnectionError,
)


@cache
def _project_dirs() -> tuple[str, ...]:
    """Folders of fot's own code: the ``fot`` package, ``fot.kernels`` and ``fot.eval``.

    ``fot.kernels`` and ``fot.eval`` live in the checkout's top-level ``kernels/`` and ``eval/``
    folders (see :mod:`fot._source_layout`), so their folders are looked up, not assumed.
    """
    import fot  # noqa: F401 - installs the finder for fot.kernels / fot.eval in a checkout

    dirs = []
    for name in ("fot", "fot.kernels", "fot.eval"):
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(str(Path(location).resolve()))
    return tuple(dirs)


def raised_outside_fot(err: BaseException) -> str | None:
    """Where ``err`` was raised when that is not fot's own code, else ``None``.

    Returns ``"<file>:<line>"`` of the innermost frame of the traceback when that frame is in
    another package (a library's own check, or a bug), ``None`` when fot raised it (also
    ``raise ... from`` a library error) or there is no traceback.
    """
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return None
    path = Path(frames[-1].filename)
    resolved = str(path.resolve())
    if any(resolved == d or resolved.startswith(d + "/") for d in _project_dirs()):
        return None
    if path.name == "train.py" and (path.parent / "fot").is_dir():  # the repository's script
        return None
    return f"{frames[-1].filename}:{frames[-1].lineno}"


def error_line(prog: str, err: BaseException, *, traceback_variable: str) -> str:
    """The message a command line prints for a user error, without a traceback.

    Args:
        prog: the command, e.g. ``"train.py"`` or ``"python -m fot.eval needle"``.
        err: the error (one of :data:`USER_ERRORS`).
        traceback_variable: the environment variable that makes the command show tracebacks.

    Returns:
        ``"<prog>: error: <message>"`` plus, on the next line, where it was raised when that
        was outside fot, and how to get the traceback.
    """
    message = str(err) or type(err).__name__
    where = raised_outside_fot(err)
    origin = f"raised by {type(err).__name__} in {where}; " if where else ""
    return f"{prog}: error: {message}\n({origin}set {traceback_variable}=1 for the traceback)"


def not_one_of(name: str, value: object, choices: Iterable[object]) -> str:
    """The message for a setting outside its choices: ``name='value' is not one of [...]``,
    and ``; did you mean 'x'?`` where ``value`` is a string close to some (a typo). ``choices``:
    any iterable (a dict gives its keys).

    >>> not_one_of("data.packing", "varlength", ["varlen", "causal", "padded"])
    "data.packing='varlength' is not one of ['varlen', 'causal', 'padded']; did you mean 'varlen'?"
    """
    choices = list(choices)
    message = f"{name}={value!r} is not one of {choices}"
    if isinstance(value, str):  # compared without case: 'JSON' is close to 'json'
        names = {c.lower(): c for c in choices if isinstance(c, str)}
        close = difflib.get_close_matches(value.lower(), list(names), n=2, cutoff=0.6)
        if close:
            message += f"; did you mean {' or '.join(repr(names[c]) for c in close)}?"
    return message


def parse_args_naming_typos(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, *, intermixed: bool = False
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with each unknown option named with the closest known ones.

    argparse says only ``unrecognized arguments: --lenght 512`` (and for an option of a
    subcommand it prints the top-level usage): this adds ``did you mean --length?`` and uses
    the usage of the subcommand given.

    Args:
        parser: the command line's parser (with or without subcommands).
        argv: the arguments (``None``: ``sys.argv[1:]``).
        intermixed: positional arguments may come after options (``a.txt --glob '*.md' b/``):
            argparse's intermixed parsing, for a parser without subcommands whose positional
            takes any number of values (it stops collecting them at the first option).

    Raises:
        SystemExit: status 2 for unknown arguments, after printing the usage and one error line.
    """
    parse = parser.parse_known_intermixed_args if intermixed else parser.parse_known_args
    args, extras = parse(argv)
    if not extras:
        return args
    target = parser
    for action in parser._actions:  # the subcommand's own parser, where one was given
        if isinstance(action, argparse._SubParsersAction):
            target = action.choices.get(getattr(args, action.dest, None), parser)
    known = [o for o in target._option_string_actions if o.startswith("--")]
    hints = []
    for extra in extras:
        if extra.startswith("-"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=3, cutoff=0.6)
            if close:
                hints.append(f"{extra}: did you mean {' or '.join(close)}?")
    more = f" ({'; '.join(hints)})" if hints else f" (see {target.prog} --help)"
    target.error(f"unrecognized arguments: {' '.join(extras)}{more}")
    raise AssertionError("argparse's error() exits")  # pragma: no cover


class WriteError(FotError, OSError):
    """A file or folder could not be written: a full disk, a used-up quota, the file size limit,
    a read-only file system or no permission. The message names the path, the cause and what
    was kept; :func:`cannot_write` builds it."""


_WRITE_HINTS = {
    "ENOSPC": "the disk is full: free space on it, or write elsewhere",
    "EDQUOT": "the disk quota is used up: free space in it, or write elsewhere",
    "EFBIG": "the file would exceed the file size limit (`ulimit -f`) or the file system's",
    "EROFS": "the file system is read-only: write elsewhere",
    "EACCES": "no permission to write there: write elsewhere, or change its permissions",
    "EPERM": "no permission to write there: write elsewhere, or change its permissions",
    "EIO": "the device reported an I/O error",
}

# When a rerun can write where a write failed with that cause: advice after the cause.
_RETRY_WHEN = {
    "ENOSPC": "once there is room",
    "EDQUOT": "once there is room in the quota",
    "EFBIG": "once the file size limit allows the file",
    "EROFS": "once the file system is writable again",
    "EACCES": "once you may write there",
    "EPERM": "once you may write there",
}
# Causes that the folder itself has (not the data written): a rerun goes on elsewhere.
_FOLDER_CAUSES = frozenset({"EROFS", "EACCES", "EPERM"})


def retry_when(err: BaseException) -> tuple[str, bool]:
    """When a rerun can write where a write failed with ``err``, for the advice that follows
    :func:`cannot_write`'s cause ("... rerun with resume=auto").

    Returns:
        ``(when, elsewhere)``: ``when`` such as ``"once there is room"`` (a full disk) or
        ``"once the file system is writable again"`` (read-only), ``"once the cause is
        fixed"`` for a cause not named here; ``elsewhere`` is true when the cause is the folder
        itself (a read-only file system, no permission), where writing to another folder is the
        way on that needs no one else.
    """
    import errno as errno_names

    cause = os_error_of(err)
    name = errno_names.errorcode.get(cause.errno or 0, "") if cause is not None else ""
    return _RETRY_WHEN.get(name, "once the cause is fixed"), name in _FOLDER_CAUSES


def os_error_of(err: BaseException) -> OSError | None:
    """The ``OSError`` behind ``err``: ``err`` itself, or one it was raised from or while
    handling (torch.save's writer reports a failed write as a ``RuntimeError`` such as
    "unexpected pos 704 vs 598", with the ``OSError`` as its context); ``None`` if there is none."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def cannot_write(path: object, err: BaseException, kept: str = "") -> WriteError | None:
    """A :class:`WriteError` for a failed write of ``path``, or ``None`` if ``err`` is not an
    ``OSError`` (nor caused by one): then it is no failing environment, and is raised as it is.

    Args:
        path: the file or folder being written.
        err: the error the write raised.
        kept: what is left as it was, said after the cause (e.g. the previous checkpoint).
    """
    import errno as errno_names
    import os

    cause = os_error_of(err)
    if cause is None:
        return None
    name = errno_names.errorcode.get(cause.errno or 0, "")
    what = cause.strerror or os.strerror(cause.errno or 0)
    hint = _WRITE_HINTS.get(name)
    message = f"cannot write {path}: {what}" + (f" ({hint})" if hint else "")
    error = WriteError(message + (f". {kept}" if kept else ""))
    error.errno = cause.errno
    return error
