"""Runs of a script that kills itself (SIGKILL) at a chosen point, for the tests of what such
a run leaves behind, and the host name in the temporary names it leaves (``from killed_runs
import run_killed``; ``tests/`` is on ``sys.path``)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path


def run_killed(script: str, out: Path, point: str) -> int:
    """Run ``python -c script out point`` (fot importable, in ``out``'s parent folder) and check
    that SIGKILL ended it; the id of its process, which has ended.

    Args:
        script: Python source that reads ``sys.argv[1]`` (``out``) and ``sys.argv[2]``
            (``point``) and kills itself there.
        out: the path the script writes.
        point: where the script kills itself (its own names).
    """
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(out), point],
        env=env,
        cwd=out.parent,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -9, stderr[-3000:]
    return proc.pid


def host_name() -> str:
    """This machine's name as fot's temporary names record it: characters other than letters,
    digits, ``_``, ``.`` and ``-`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
