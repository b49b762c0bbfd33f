"""The benchmarks' embedded PostgreSQL stops with them, even when they are stopped by `kill`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import time
from bench.db import EmbeddedPostgres
with EmbeddedPostgres() as pg:
    print(pg.pid(), pg.parent, flush=True)
    time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_benchmark_stopped_by_sigterm_stops_its_postgres() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        pid_text, parent = proc.stdout.readline().split()
        pid = int(pid_text)
        try:
            assert alive(pid)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 128 + signal.SIGTERM
            for _ in range(100):  # the server stopped before the process exited; allow a moment
                if not alive(pid):
                    break
                time.sleep(0.1)
            assert not alive(pid), "the embedded PostgreSQL outlived its benchmark"
            assert not os.path.exists(parent)
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGINT)  # a fast shutdown of the orphan
            if proc.poll() is None:
                proc.kill()
