"""Hidden names of files and folders written first and renamed into place once complete, and
the ones a killed process left behind.

A writer stages its target under a hidden name holding :func:`writer_tag`, this host's name and
this process' id: ``.summary.json.node7.4242.tmp.json``
(:func:`fot.training.checkpoint.written_whole`), ``.hf.new-node7.4242`` and ``.hf.old-node7.4242``
(:func:`fot.export.export_hf`), ``.corpus.tmp-node7.4242`` and ``.corpus.old-node7.4242``
(:mod:`fot.data.tokens`, for ``fot.data.prepare`` and the sample corpus' cache). A process killed while writing (SIGKILL, the OOM killer, a
power loss) leaves that name for good, and each rerun adds one with another id.
:func:`ended_writers` finds such leftovers, so that the next write of the same target removes
them (or, where one may hold the only copy of something, names it).

A process id means something only on its own host, and several hosts may write one folder of a
shared file system: a name with another host's name is always kept; one with this host's is
left by a process that has ended when no process has its id (``os.kill(pid, 0)``), or when it
is this process' own id (the caller has not staged its own yet: it is an earlier process's that
had the same id, e.g. a restarted container's). Names written before the host was recorded
(``.summary.json.4242.tmp.json``, ``.hf.new-4242``) do not say which host's id they hold: they
count as left by an ended process when no other process here has that id and they have not
changed for :data:`UNRECORDED_HOST_AGE_S` (a live writer's file changes while it is written,
and lives seconds to minutes), so an earlier fot still writing on another host keeps its file.
The token-folder writers of an earlier fot staged under names of other shapes (``prepare``'s
``.corpus.new-4242``, the sample cache's ``.sample-shakespeare-v1.4242``, each written through
``..corpus.new-4242.tmp-4242``): :func:`ended_earlier_writers` finds them by the same rules.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

# Host names may hold any character; a staged name keeps those of a DNS name (a dot separates
# the host from the process id, which is digits only, so a dotted host name parses). A "+N"
# after the id tells apart a folder this process stages from a kept one of an earlier process
# with the same id (fot.export's folder set aside).
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
_TAG = r"(?:(?P<host>[A-Za-z0-9_.-]+)\.)?(?P<pid>[0-9]{1,9})(?:\+[0-9]+)?"

UNRECORDED_HOST_AGE_S = 24 * 3600
"""How long a staged name of an earlier fot (no host in it) must be unchanged to count as left
by an ended process (module docstring)."""


def writer_tag() -> str:
    """``{host}.{pid}`` of this process, for the hidden name of what it stages (module
    docstring)."""
    return f"{_HOST}.{os.getpid()}"


@dataclass(frozen=True)
class Leftover:
    """A staged file or folder whose writer has ended (:func:`ended_writers`)."""

    path: Path
    pid: int
    host: str | None
    """None for a name of an earlier fot, which did not record the host."""

    def writer(self) -> str:
        """Who left it, for a message: ``"process 4242 of this host"``."""
        if self.host is None:
            return f"process {self.pid}, host not recorded, unchanged for over a day"
        return f"process {self.pid} of this host"


def ended_writers(folder: str | os.PathLike, prefix: str, suffix: str = "") -> list[Leftover]:
    """The entries of ``folder`` named ``prefix + writer_tag() + suffix`` (or, by an earlier
    fot, ``prefix + pid + suffix``) whose writer has ended (module docstring), by name.

    One listing of ``folder`` (none of it if it cannot be listed), and a check of each entry
    that matches.
    """
    pattern = re.compile(re.escape(prefix) + _TAG + re.escape(suffix))
    found = []
    for name, path in _listing(folder):
        m = pattern.fullmatch(name)
        if m and _has_ended(m["host"], int(m["pid"]), path):
            found.append(Leftover(path, int(m["pid"]), m["host"]))
    return found


def ended_earlier_writers(folder: str | os.PathLike, *names: tuple[str, ...]) -> list[Leftover]:
    """The folders in ``folder`` that an earlier fot staged under names without the host, whose
    writer has ended (no other process here has the id, and unchanged for
    :data:`UNRECORDED_HOST_AGE_S`: module docstring), by name. Each of ``names`` gives such a
    name as its parts joined by one process id: ``("..tok.new-", ".tmp-", "")`` is
    ``..tok.new-4242.tmp-4242``.

    Only folders count: those names were all folders, and a file of such a name is not fot's.
    """
    patterns = [
        re.compile(
            re.escape(parts[0])
            + r"(?P<pid>[0-9]{1,9})"
            + r"(?P=pid)".join(map(re.escape, parts[1:]))
        )
        for parts in names
    ]
    found = []
    for name, path in _listing(folder):
        m = next((m for p in patterns if (m := p.fullmatch(name))), None)
        if m and path.is_dir() and not path.is_symlink() and _has_ended(None, int(m["pid"]), path):
            found.append(Leftover(path, int(m["pid"]), None))
    return found


def _listing(folder: str | os.PathLike) -> list[tuple[str, Path]]:
    """``(name, path)`` of each entry of ``folder``, sorted by name; none where it cannot be
    listed (no folder yet, or not readable: the write itself reports it)."""
    try:
        return sorted((e.name, Path(e.path)) for e in os.scandir(folder))
    except OSError:
        return []


def remove(leftovers: list[Leftover]) -> list[Leftover]:
    """Delete the files and folders of ``leftovers``; return those that are gone (one that
    cannot be deleted, e.g. another user's in a folder of theirs, is kept)."""
    gone = []
    for left in leftovers:
        if left.path.is_dir() and not left.path.is_symlink():
            shutil.rmtree(left.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                left.path.unlink()
        if not os.path.lexists(left.path):
            gone.append(left)
    return gone


def set_aside_name(folder: str | os.PathLike, prefix: str) -> Path:
    """A new name ``folder / (prefix + writer_tag())`` to set something aside under while it is
    replaced; ``+1``, ``+2``, ... after it where an earlier process with this id left one
    (kept: it may hold the only copy of what it set aside)."""
    name = Path(folder) / f"{prefix}{writer_tag()}"
    n = 0
    while os.path.lexists(name):
        n += 1
        name = Path(folder) / f"{prefix}{writer_tag()}+{n}"
    return name


def remove_and_log(leftovers: list[Leftover], logger: logging.Logger, what: str) -> None:
    """:func:`remove` ``leftovers`` and log one warning naming those gone, left by ``what``
    (``"writes of <path>"``, ``"exports into <path>"``) that did not finish."""
    gone = remove(leftovers)
    if gone:
        logger.warning(
            "removed %s: left by %s that did not finish (%s)",
            ", ".join(str(left.path) for left in gone),
            what,
            "; ".join(left.writer() for left in gone),
        )


def _has_ended(host: str | None, pid: int, path: Path) -> bool:
    if host is not None and host != _HOST:
        return False
    if pid != os.getpid() and _alive(pid):
        return False
    return host is not None or time.time() - _last_change(path) > UNRECORDED_HOST_AGE_S


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _last_change(path: Path) -> float:
    """The newest modification time of ``path`` and, for a folder, of its entries (an export
    is a flat folder; a shard being written changes its own time, not the folder's)."""
    try:
        times = [path.lstat().st_mtime]
        if path.is_dir() and not path.is_symlink():
            times += [p.lstat().st_mtime for p in path.iterdir()]
    except OSError:  # gone, or renamed into place by its writer just now
        return time.time()
    return max(times)
