"""idem_middleware/orphans.py: a killed run's embedded server is stopped by the next run, by
PID, and only if its owner is gone and the PID is still that server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from idem_middleware.orphans import OWNER_FILE, mark_owner, reap_orphans


def _fake_server(data_dir: Path) -> subprocess.Popen[bytes]:
    """A process whose command line looks like a postmaster's for `data_dir`. Like a postmaster,
    it sets its own SIGQUIT handling: a suite run as a background job (`pytest &`) would hand it
    SIGQUIT ignored, and the reaper's signal would never stop it."""
    code = (
        "import signal, time; signal.signal(signal.SIGQUIT, signal.SIG_DFL); "
        "print('ready', flush=True); time.sleep(60)"
    )
    argv = [sys.executable, "-c", code, "postgres", "-D", str(data_dir)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    proc.stdout.close()
    assert ready == b"ready\n"  # its SIGQUIT handling is set
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    return proc.pid


def _parent(tmp_path: Path, name: str, owner: int, server: int) -> Path:
    parent = tmp_path / name
    (parent / "data").mkdir(parents=True)
    (parent / OWNER_FILE).write_text(str(owner))
    (parent / "data" / "postmaster.pid").write_text(f"{server}\n{parent / 'data'}\n")
    return parent


def test_an_orphaned_server_is_stopped_and_its_directory_removed(tmp_path: Path) -> None:
    orphan_dir = tmp_path / "idem-test-pg-orphan" / "data"
    server = _fake_server(orphan_dir)
    live_server = _fake_server(tmp_path / "idem-test-pg-live" / "data")
    try:
        orphan = _parent(tmp_path, "idem-test-pg-orphan", _dead_pid(), server.pid)
        live = _parent(tmp_path, "idem-test-pg-live", os.getpid(), live_server.pid)
        other = tmp_path / "other-prefix"
        other.mkdir()
        assert reap_orphans(tmp_path, "idem-test-pg-") == [server.pid]
        assert server.wait(10) != 0  # stopped by the signal
        assert not orphan.exists()
        assert live.exists()  # its owner (we) is alive
        assert live_server.poll() is None
        assert other.exists()
    finally:
        for proc in (server, live_server):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_reused_pid_is_not_signalled(tmp_path: Path) -> None:
    """The postmaster.pid names a process that is not that server any more: left alone."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        parent = _parent(tmp_path, "idem-test-pg-stale", _dead_pid(), bystander.pid)
        assert reap_orphans(tmp_path, "idem-test-pg-") == []
        assert bystander.poll() is None
        assert not parent.exists()  # the directory of a dead run is still removed
    finally:
        bystander.kill()
        bystander.wait(10)


def test_mark_owner_writes_this_process(tmp_path: Path) -> None:
    mark_owner(tmp_path)
    assert (tmp_path / OWNER_FILE).read_text() == str(os.getpid())
