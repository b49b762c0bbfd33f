"""The suite's own workers (tests/conftest.py): with IDEM_TEST_DSN, one server's databases and
roles are named alike by every worker, so `-n auto` runs one process and `-n 2` stops at once
with a usage error, before a test runs (workers dropping each other's databases mid-run, their
tests failing at random, was the alternative)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: A quick file of the suite that needs no database.
QUICK = "tests/unit/test_module_sizes.py"


def _run(workers: str, dsn: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.pop("IDEM_TEST_DSN", None)
    if dsn is not None:
        env["IDEM_TEST_DSN"] = dsn
    command = [sys.executable, "-m", "pytest", "-n", workers, "-p", "no:cacheprovider", QUICK]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_two_workers_on_one_given_server_stop_at_once_saying_why() -> None:
    done = _run("2", "postgresql://nobody@127.0.0.1:9/none")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done
    assert "IDEM_TEST_DSN with -n 2" in done.stderr, done.stderr
    assert "passed" not in done.stdout


def test_auto_runs_one_process_with_a_given_server_and_workers_without() -> None:
    given = _run("auto", "postgresql://nobody@127.0.0.1:9/none")
    assert given.returncode == 0, given
    assert "workers" not in given.stdout, given.stdout
    assert "3 passed" in given.stdout, given.stdout
    alone = _run("auto", None)
    assert alone.returncode == 0, alone
    assert "created: " in alone.stdout, alone.stdout
    assert "3 passed" in alone.stdout, alone.stdout
