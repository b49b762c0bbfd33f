"""Embedded PostgreSQL servers left behind by test runs that were killed (SIGKILL, a CI timeout),
the pytest plugin's and this repository's own: each run writes its PID next to its server's data
directory, and the next run stops the servers whose owner is gone (checking, by its command line,
that the PID is still that server) and removes their directories. A directory whose server may
still run (its PID alive, and not known to be another program) is left as it is."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

OWNER_FILE = "owner.pid"
#: Where a process's state and command line are read (Linux); where there is none (macOS), a
#: process `kill(pid, 0)` finds is taken as running, and as possibly the server.
_PROC = Path("/proc")


def mark_owner(parent: Path) -> None:
    """Record this process as the owner of the server under `parent`."""
    (parent / OWNER_FILE).write_text(str(os.getpid()))


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return not _PROC.is_dir()  # (no /proc: it runs, as far as can be told)
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def _argv(pid: int) -> list[bytes] | None:
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None  # gone meanwhile, or no /proc


def _is_server_of(pid: int, data_dir: Path) -> bool:
    """Whether `pid` is still a postgres whose command line names `data_dir` (not a reused PID).
    Under either spelling: embedded_postgres hands the server the resolved path, so a temporary
    directory reached through a symlink (macOS's /var, a symlinked TMPDIR) is named otherwise."""
    argv = _argv(pid)
    if argv is None or not any(b"postgres" in a for a in argv):
        return False
    try:
        resolved = data_dir.resolve()
    except (OSError, RuntimeError):  # (a symlink loop)
        resolved = data_dir
    return any(str(path).encode() in argv for path in (data_dir, resolved))


def _another_program(pid: int) -> bool:
    """Whether `pid` is known not to be a postgres (its PID reused by something else)."""
    argv = _argv(pid)
    return argv is not None and not any(b"postgres" in a for a in argv)


def reap_orphans(tmp: Path, prefix: str) -> list[int]:
    """Stop the servers under `tmp/<prefix>*` whose owner process is gone; return their PIDs."""
    stopped: list[int] = []
    for parent in sorted(tmp.glob(prefix + "*")):
        try:
            owner = int((parent / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or still being set up
        if _alive(owner):
            continue
        postmaster, running = _stop_server(parent / "data")
        if postmaster is not None:
            stopped.append(postmaster)
        if not running:
            shutil.rmtree(parent, ignore_errors=True)
    return stopped


def abandon(parent: Path) -> None:
    """A server's set-up cut short (interrupted, failed): its server stopped if one started, and
    its directory removed. Whatever a process of the set-up still writes there (initdb's) is
    left under the owner file, for the next run's `reap_orphans` (without it, for ever)."""
    if _stop_server(parent / "data")[1]:
        return  # (a server that may still run: the next run looks again)
    shutil.rmtree(parent / "data", ignore_errors=True)
    if not (parent / "data").exists():
        shutil.rmtree(parent, ignore_errors=True)


def _stop_server(data_dir: Path) -> tuple[int | None, bool]:
    """Stop the server `data_dir/postmaster.pid` names, if it runs and is this directory's
    (immediate shutdown: its children go with it). Its PID if stopped, and whether a process
    that may be it still runs: never its directory from under it (one not stopped yet, or one
    its command line was not matched to)."""
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None, False
    if postmaster <= 0 or not _alive(postmaster):
        return None, False
    stopped = None
    if _is_server_of(postmaster, data_dir):
        os.kill(postmaster, signal.SIGQUIT)
        for _ in range(100):  # bounded: 5 s
            if not _alive(postmaster):
                break
            time.sleep(0.05)
        stopped = postmaster
    return stopped, _alive(postmaster) and not _another_program(postmaster)
