"""``python -m fot.eval <command>`` (also the ``fot-eval`` console script).

Every command takes an exported checkpoint folder, writes machine-readable results, a
``run_config.json`` and (where useful) a plot under ``--out``, shows progress, and resumes
from ``--out`` after an interruption.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from fot.errors import USER_ERRORS, error_line
from fot.eval import program_name
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
        return cli(sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import fot  # noqa: F401 - installs fot.eval for source checkouts, registers FoT models

    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        command, missing = args._missing
        raise SystemExit(
            f"`{command}` needs the package {missing!r}, which is not installed: "
            "pip install 'fot[eval]' (or pip install lm-eval)"
        )
    if getattr(args, "out", None) is not None and getattr(args, "checkpoint", None):
        from fot.eval.common import check_out_dir

        check_out_dir(args.out, args.checkpoint)
    mod = importlib.import_module(f"fot.eval.{args._module}")
    del args._module
    return mod.run(args)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it stops as on Ctrl-C."""


def cli(argv: Sequence[str]) -> int:
    """Run :func:`main` for the command line; returns the process exit status.

    Errors that name the problem (:data:`fot.errors.USER_ERRORS`) print as one ``error:``
    message (status 2) and Ctrl-C prints how to resume (status 130), without a traceback
    unless the environment variable ``FOT_EVAL_TRACEBACK`` is ``1``. SIGTERM (Slurm's time
    limit, ``timeout``, torchrun passing its own on) stops as Ctrl-C does, so that what each
    command saves on an interruption is saved (status 143).
    """
    show_traceback = os.environ.get("FOT_EVAL_TRACEBACK") == "1"
    command = next((a for a in argv if a in COMMANDS), "")
    prog = f"{program_name()} {command}".rstrip()
    try:
        # a second SIGTERM (a rank may get the scheduler's and torchrun's) is ignored, so that
        # it does not cut into the saving that the first one starts
        with StopOnSignal((signal.SIGTERM,), _Terminated):
            main(argv)
    except KeyboardInterrupt as err:
        if show_traceback:
            raise
        terminated = isinstance(err, _Terminated)
        print(
            f"\n{prog}: {'stopped by SIGTERM' if terminated else 'interrupted'}; finished items "
            "are saved in --out: rerun the same command to resume",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM if terminated else 130
    except USER_ERRORS as err:
        if show_traceback:
            raise
        print(error_line(prog, err, traceback_variable="FOT_EVAL_TRACEBACK"), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
