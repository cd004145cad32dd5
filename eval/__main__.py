"""``python -m fot.eval <command>`` (also the ``fot-eval`` console script).

Every command takes an exported checkpoint folder (or a hub repository id, downloaded), writes
machine-readable results, a ``run_config.json`` and (where useful) a plot under ``--out``,
shows progress, and resumes from ``--out`` after an interruption.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from fot.errors import (
    USER_ERRORS,
    FotError,
    WriteError,
    cannot_write,
    error_line,
    parse_args_naming_typos,
)
from fot.eval import program_name
from fot.hub import is_hub_repo_id, local_folder
from fot.interrupt import StopOnSignal

COMMANDS = {
    "per-token-loss": ("per_token_loss", "L(i) per position, P(l) and horizon averages"),
    "needle": ("needle", "needle in a haystack (easy/standard) and passkey retrieval grid"),
    "forgetting-curve": ("forgetting_curve", "copy vs LM accuracy over length (Liu et al.)"),
    "lm-eval": ("lm_eval_adapter", "the paper's zero-shot suite through lm-evaluation-harness"),
    "longbench": ("longbench", "the paper's 14 English LongBench tasks from local jsonl"),
    "gates": ("gates", "forget-gate matrix F and attention maps of chosen layers/heads"),
}

# Packages of the `eval` extra that a command may need; without them the other commands work.
OPTIONAL_PACKAGES = ("lm_eval", "sqlitedict")


def spell_command(argv: Sequence[str]) -> list[str]:
    """``argv`` with its command as :data:`COMMANDS` spells it: ``per_token_loss`` (the module's
    and the Python function's spelling) is taken for ``per-token-loss``."""
    argv = list(argv)
    i = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if i is not None and argv[i] not in COMMANDS and argv[i].replace("_", "-") in COMMANDS:
        argv[i] = argv[i].replace("_", "-")
    return argv


def build_parser() -> argparse.ArgumentParser:
    """The CLI parser; each command's options come from its module's ``add_arguments``.

    Its program name (in usage lines and errors) is what the user ran:
    :func:`fot.eval.program_name`."""
    parser = argparse.ArgumentParser(
        prog=program_name(),
        description="Evaluate an exported FoT (or any Hugging Face causal LM) checkpoint.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(f"fot.eval.{module}")
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] not in OPTIONAL_PACKAGES:
                raise
            # An optional extra is not installed: the other commands still work.
            missing = err.name.split(".")[0]
            p = sub.add_parser(name, help=f"{help_text} [needs {missing}]", description=help_text)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(_missing=(name, missing))
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> Any:
    """Run one evaluation command.

    Args:
        argv: the arguments after ``python -m fot.eval``; ``None`` reads ``sys.argv`` (the
            ``fot-eval`` console script, which calls ``sys.exit(main())``).

    Returns:
        The command's result (summary dict) when ``argv`` is given; ``0`` when it is ``None``,
        so that the console script exits with status 0 after a successful run (``sys.exit``
        of a dict would print it to stderr and exit with status 1).
    """
    if argv is None:
        return cli(sys.argv[1:], exiting=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import fot  # noqa: F401 - installs fot.eval for source checkouts, registers FoT models

    args = parse_args_naming_typos(build_parser(), spell_command(argv))
    if getattr(args, "_missing", None):
        command, missing = args._missing
        raise SystemExit(
            f"`{command}` needs the package {missing!r}, which is not installed: "
            "pip install 'fot[eval]' (or pip install lm-eval)"
        )
    from fot.progress import quiet_library_bars
    from fot.training.parallel import adopt_slurm_tasks

    adopt_slurm_tasks(program_name())  # `srun python -m fot.eval ...` with several tasks
    quiet_library_bars(int(os.environ.get("RANK", "0") or 0))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args._module != "per_token_loss":
        command = next(name for name in COMMANDS if COMMANDS[name][0] == args._module)
        raise ValueError(
            f"`{command}` runs in one process, but {world} were started (torchrun or srun), "
            "each of which would run all of it into the same --out: start it as one process "
            "(per-token-loss is the command that splits its documents over processes)"
        )
    if getattr(args, "checkpoint", None) and is_hub_repo_id(args.checkpoint):
        # the local copy from here on; run_config.json's arguments keep the id
        args.checkpoint_hub_id = args.checkpoint
        args.checkpoint = str(local_folder(args.checkpoint))
    from fot.eval.common import lock_out, release_out_locks

    if getattr(args, "out", None) is not None and getattr(args, "checkpoint", None):
        from fot.eval.common import check_out_dir

        check_out_dir(args.out, args.checkpoint)
    mod = importlib.import_module(f"fot.eval.{args._module}")
    del args._module
    failed = True
    try:
        if world == 1 and getattr(args, "out", None) is not None:
            # a second run into the same --out is refused now, before the model loads (a new
            # --out is made to be locked; under torchrun, rank 0 locks it in the command)
            lock_out(args.out, resumes=args.command != "gates")
        result = mod.run(args)
        failed = False
        return result
    except OSError as err:
        # gates rewrites its --out whole: nothing of it is resumed
        error = _write_error(err, getattr(args, "out", None), resumes=args.command != "gates")
        if error is None:
            raise
        raise error from err
    finally:
        release_out_locks(failed=failed)


# Errors only a write gives (a full disk, a used-up quota, the file size limit, a read-only
# file system): each is the one-line WriteError, not a traceback from inside pathlib or numpy.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _write_error(err: OSError, out: str | None, *, resumes: bool) -> WriteError | None:
    """The :class:`~fot.errors.WriteError` for ``err``, a failed write of a command's
    results, or ``None`` when ``err`` is no write error (it is raised as it is).

    The message names the file, the cause and its fix, and, for a command that ``resumes``,
    what is kept: the items finished before it, which rerunning the same command resumes from
    (every command saves each item whole, or through a temporary file and a rename). A
    :class:`~fot.errors.WriteError` already (a result file written whole,
    :func:`fot.training.checkpoint.written_whole`) gets that advice added to its message."""
    if err.errno not in _WRITE_ERRNOS or (
        isinstance(err, FotError) and not isinstance(err, WriteError)
    ):
        return None
    # a folder that holds only the lock holds no results (a new --out goes with the lock)
    kept = (
        f"Items finished before it are kept in {str(out)!r}: rerun the same command to resume"
        if resumes and out is not None and _holds_results(out)
        else ""
    )
    if isinstance(err, WriteError):
        if not kept:
            return None
        error = WriteError(f"{err}. {kept}")
        error.errno = err.errno
        return error
    path = err.filename if err.filename is not None else out
    return cannot_write(path, err, kept)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it stops as on Ctrl-C."""


def _out_folder(argv: Sequence[str]) -> str | None:
    """The ``--out`` that ``argv`` names, read as the command's parser reads it, or None."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--out")
    try:
        return parser.parse_known_args(list(argv))[0].out
    except argparse.ArgumentError:
        return None


def _stopped_line(
    prog: str, argv: Sequence[str], *, signal_name: str, finished: bool, resumes: bool
) -> str:
    """The line printed when the command is stopped: by what, what is saved where, and how
    to resume (or, for a command that does not ``resume``, to run it again)."""
    out = _out_folder(argv)
    where = repr(out) if out else "--out"
    if finished:
        again = "rerunning the same command resumes from them" if resumes else "all of this run"
        return f"{prog}: {signal_name} after it had finished: every result is saved in {where} ({again})"
    if not resumes:
        # gates keeps no partial state: --out holds the previous run's results, or some whole
        # files of this one if it stopped while writing them (eval/gates.py)
        return (
            f"{prog}: {signal_name} before it finished; it does not resume, and {where} may "
            "hold an earlier run's results or only part of this one's: rerun the same command "
            "to compute them all again"
        )
    if out and not _holds_results(out):  # a new --out goes when nothing was written to it
        return f"{prog}: {signal_name} before its first result; nothing was written"
    return f"{prog}: {signal_name}; finished items are saved in {where}: rerun the same command to resume"


def _holds_results(out: str) -> bool:
    """Whether the folder ``out`` exists and holds more than its run lock."""
    from fot.training.checkpoint import RUN_LOCK

    return os.path.isdir(out) and any(name != RUN_LOCK for name in os.listdir(out))


def cli(argv: Sequence[str], *, exiting: bool = False) -> int:
    """Run :func:`main` for the command line; returns the process exit status.

    Errors that name the problem (:data:`fot.errors.USER_ERRORS`) print as one ``error:``
    message (status 2) and Ctrl-C prints what is saved in ``--out`` and how to resume (status
    130), without a traceback unless the environment variable ``FOT_EVAL_TRACEBACK`` is
    ``1``. SIGTERM (Slurm's time limit, ``timeout``, torchrun passing its own on) stops as
    Ctrl-C does, so that what each command saves on an interruption is saved (status 143);
    one that came while the command finished (its raise lost in a ``__del__``) says that
    every result is saved (status 143).

    Args:
        argv: the arguments after the program name.
        exiting: the process exits when this returns (the ``python -m fot.eval`` and
            ``fot-eval`` entry points): SIGTERM stays handled, so that one that comes after
            the command has finished (while Python shuts down) prints the same line and exits
            with status 143 instead of killing the process without a word. Left ``False``
            (calls from Python), the previous SIGTERM handler is back when this returns.
    """
    show_traceback = os.environ.get("FOT_EVAL_TRACEBACK") == "1"
    argv = spell_command(argv)
    command = next((a for a in argv if a in COMMANDS), "")
    prog = f"{program_name()} {command}".rstrip()
    resumes = command != "gates"  # gates rewrites its --out whole: nothing of it is resumed
    finished = False

    def after_the_command(signum: int, frame: object) -> None:
        # SIGTERM outside the command (cli's StopOnSignal): nothing is left to save
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            line = _stopped_line(
                prog, argv, signal_name="stopped by SIGTERM", finished=finished, resumes=resumes
            )
            print(f"\n{line}", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    if (
        exiting
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    ):
        signal.signal(signal.SIGTERM, after_the_command)  # StopOnSignal puts it back
    try:
        # a second SIGTERM (a rank may get the scheduler's and torchrun's) is ignored, so that
        # it does not cut into the saving that the first one starts
        with StopOnSignal((signal.SIGTERM,), _Terminated) as stop:
            main(argv)
            finished = True
            stop.check()  # a SIGTERM whose raise was lost (in a __del__) after the last check
    except BrokenPipeError:
        # stdout's reader went (`| head -1`): quiet, with the status of a process that SIGPIPE
        # ends, as other commands in a pipe; what the command writes to --out is not stdout
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as err:
        if show_traceback:
            raise
        terminated = isinstance(err, _Terminated)
        how = "stopped by SIGTERM" if terminated else "interrupted"
        line = _stopped_line(prog, argv, signal_name=how, finished=finished, resumes=resumes)
        print("\n" + line, file=sys.stderr)
        return 128 + signal.SIGTERM if terminated else 130
    except USER_ERRORS as err:
        if show_traceback:
            raise
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1:  # each process prints its own error (another's may differ): say whose
            prog = f"{prog} (rank {os.environ.get('RANK', '0')} of {world})"
        print(error_line(prog, err, traceback_variable="FOT_EVAL_TRACEBACK"), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:], exiting=True))
