"""The reaper of orphaned test servers (idem_middleware/orphans.py) at its edges: a zombie
owner is a dead one; a process it may not signal is a live one; a bystander whose command line
names the directory but is no postgres is never signalled; the server's command line may name
the directory under the spelling it was given; a half-written owner file or postmaster.pid
neither stops the run nor loses the directory; another prefix's directories are not its own;
a PID file naming no process (0) never keeps a directory; and a set-up cut short never removes
the directory of a server that may still run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from idem_middleware import orphans
from idem_middleware.orphans import OWNER_FILE, reap_orphans
from tests.unit.test_orphans import _dead_pid, _fake_server, _parent

PREFIX = "idem-test-pg-"


def _zombie() -> subprocess.Popen[bytes]:
    """A child that has exited and is not reaped yet (its parent, this process, has not waited)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    stat = Path(f"/proc/{proc.pid}/stat")
    for _ in range(200):  # bounded: 10 s
        text = stat.read_text()
        if text[text.rindex(")") + 2 :].split()[0] == "Z":
            return proc
        time.sleep(0.05)
    raise AssertionError("the child did not exit")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_zombie_owner_is_dead_and_its_server_reaped(tmp_path: Path) -> None:
    owner = _zombie()
    server = _fake_server(tmp_path / f"{PREFIX}z" / "data")
    try:
        parent = _parent(tmp_path, f"{PREFIX}z", owner.pid, server.pid)
        assert reap_orphans(tmp_path, PREFIX) == [server.pid]
        assert server.wait(10) != 0
        assert not parent.exists()
    finally:
        owner.wait(10)
        if server.poll() is None:
            server.kill()
            server.wait(10)


def test_an_owner_it_may_not_signal_is_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's process (kill(pid, 0) is refused): running, as far as can be told."""
    owner = _dead_pid()
    kill = os.kill

    def refused(pid: int, sig: int) -> None:
        if pid == owner:
            raise PermissionError(1, "Operation not permitted")
        kill(pid, sig)

    monkeypatch.setattr(os, "kill", refused)
    parent = _parent(tmp_path, f"{PREFIX}theirs", owner, _dead_pid())
    assert reap_orphans(tmp_path, PREFIX) == []
    assert parent.exists()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_bystander_naming_the_directory_is_not_signalled(tmp_path: Path) -> None:
    """The PID reused by a program that names the directory (a `tail -f` of its log), not a
    postgres: never signalled; the dead run's directory is still removed."""
    data_dir = tmp_path / f"{PREFIX}tail" / "data"
    code = "print('ready', flush=True); import time; time.sleep(60)"
    bystander = subprocess.Popen(
        [sys.executable, "-c", code, str(data_dir)], stdout=subprocess.PIPE
    )
    try:
        assert bystander.stdout is not None
        assert bystander.stdout.readline() == b"ready\n"
        bystander.stdout.close()
        parent = _parent(tmp_path, f"{PREFIX}tail", _dead_pid(), bystander.pid)
        assert reap_orphans(tmp_path, PREFIX) == []
        assert bystander.poll() is None
        assert not parent.exists()
    finally:
        bystander.kill()
        bystander.wait(10)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_half_written_files_neither_stop_the_run_nor_lose_a_directory(tmp_path: Path) -> None:
    """An owner file still being written (empty, or cut mid-number) is skipped, its directory
    kept; an empty postmaster.pid (a server still starting) names no server: its dead run's
    directory is removed. The run goes on to the next."""
    starting = tmp_path / f"{PREFIX}a-starting"
    starting.mkdir()
    (starting / OWNER_FILE).write_text("")
    garbled = tmp_path / f"{PREFIX}b-garbled"
    garbled.mkdir()
    (garbled / OWNER_FILE).write_text("12x")
    empty = _parent(tmp_path, f"{PREFIX}c-empty", _dead_pid(), _dead_pid())
    (empty / "data" / "postmaster.pid").write_text("")
    later = _parent(tmp_path, f"{PREFIX}d-later", _dead_pid(), _dead_pid())
    assert reap_orphans(tmp_path, PREFIX) == []
    assert starting.exists()
    assert garbled.exists()
    assert not empty.exists()
    assert not later.exists()


def test_another_prefix_is_left_alone(tmp_path: Path) -> None:
    """A directory of another tool's, with an owner file of a dead process: not its own."""
    other = _parent(tmp_path, "other-tool-x", _dead_pid(), _dead_pid())
    ours = _parent(tmp_path, f"{PREFIX}x", _dead_pid(), _dead_pid())
    assert reap_orphans(tmp_path, PREFIX) == []
    assert other.exists()
    assert not ours.exists()


def test_a_pid_file_naming_no_process_keeps_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """postmaster.pid naming PID 0 (kill(0, ...) is this process's group, always there): no
    server; without /proc (macOS) too, the dead run's directory is removed."""
    monkeypatch.setattr(orphans, "_PROC", tmp_path / "no-proc")
    parent = _parent(tmp_path, f"{PREFIX}zero", _dead_pid(), 0)
    assert reap_orphans(tmp_path, PREFIX) == []
    assert not parent.exists()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_set_up_cut_short_keeps_the_directory_of_a_server_it_could_not_match(
    tmp_path: Path,
) -> None:
    """`abandon` with a live postgres its command line does not match to the directory (it may
    be the server under another spelling): nothing signalled, nothing removed from under it."""
    server = _fake_server(tmp_path / "elsewhere" / "data")
    try:
        cut = _parent(tmp_path, f"{PREFIX}cut", os.getpid(), server.pid)
        orphans.abandon(cut)
        assert server.poll() is None
        assert (cut / "data" / "postmaster.pid").exists()
        assert (cut / OWNER_FILE).exists()
    finally:
        server.kill()
        server.wait(10)
