"""`python -m example_app.tour --url URL` against an app that cannot take the tour, and Ctrl-C
while the tour stops what it started (docs/example-app.md: the tour)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from example_app.launcher import ROOT, ServerProcess, free_port
from tests.conftest import _fresh_database


def _tour(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "BANK_URL"}}
    return subprocess.run(
        [sys.executable, "-m", "example_app.tour", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
async def tour_db(admin_dsn: str) -> str:
    return await _fresh_database(admin_dsn, "idem_example_tour_url")


def _app(database: str, **env: str) -> ServerProcess:
    env = {"DATABASE_URL": database, "EXAMPLE_PUBLISH": "0", **env}
    return ServerProcess("example_app", env=env, unset=["BANK_URL"], ready_path="/openapi.json")


def test_no_app_at_the_url_is_said_before_the_first_step() -> None:
    """Before: "The tour stopped: All connection attempts failed"."""
    url = f"http://127.0.0.1:{free_port()}"
    done = _tour("--url", url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"no app answers at {url}" in done.stderr
    assert "=== (a)" not in done.stdout


def test_an_app_that_refuses_the_tours_token_is_said_before_the_first_step(
    tour_db: str,
) -> None:
    """Before: "the second request was not a replay of the first" (two 401s, after step (a)
    had begun)."""
    with _app(tour_db, EXAMPLE_TOKENS="other:tenant-x") as app:
        done = _tour("--url", app.url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "refuses the tour's token (Bearer demo-a, tenant-a)" in done.stderr
    assert "EXAMPLE_TOKENS" in done.stderr
    assert "=== (a)" not in done.stdout


def test_an_app_whose_bank_is_elsewhere_is_said_before_the_first_step(
    tour_db: str, bank: ServerProcess
) -> None:
    """An app with BANK_URL (or `--workers 2`) mounts no bank under /bank. Before, steps (a)
    to (c) ran, then: "the bank refused the faults {'fail_after_record': 500}: 404"."""
    with _app(tour_db, BANK_URL=bank.url) as app:
        done = _tour("--url", app.url)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"no bank simulator answers at {app.url}/bank" in done.stderr
        assert "--bank-url" in done.stderr
        assert "=== (a)" not in done.stdout
        # Given its bank, the tour runs (the steps that need no process of its own).
        given = _tour("--url", app.url, "--bank-url", bank.url)
    assert given.returncode == 0, given.stdout + given.stderr
    assert "no money lost, none sent twice" in given.stdout


def test_ctrl_c_while_the_tour_stops_its_servers_stops_all_of_them() -> None:
    """A Ctrl-C that lands while the tour is stopping (pressed twice, or as the tour ends):
    before, it cut the stops short, and the bank simulator was left running."""
    script = textwrap.dedent(
        """
        import os, signal
        from example_app import launcher, tour_stack

        # Ctrl-C at a terminal, whatever this child inherited: a pytest started as a shell's
        # background job (`&`, no job control) passes SIGINT on ignored, and the tour with it
        # (rightly) ignores the Ctrl-C: that was this test's flake ("interrupted" missing).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        real_stop = launcher.ServerProcess.stop

        def stop(self):
            if self.module == "example_app":  # the first stop: Ctrl-C comes now
                os.kill(os.getpid(), signal.SIGINT)
            real_stop(self)

        launcher.ServerProcess.stop = stop
        try:
            with tour_stack.local_stack() as (app, bank):
                print("pids", app.pid, bank.pid, app.cwd, flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "BANK_URL"}}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "pids" in done.stdout, done.stdout + done.stderr
    app_pid, bank_pid, workdir = done.stdout.split("pids", 1)[1].split()[:3]
    alive = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.pid in (int(app_pid), int(bank_pid)) or workdir in " ".join(p.info["cmdline"] or [])
    ]
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for proc in alive:  # (this test's own leftovers: its app, bank and PostgreSQL)
        proc.kill()
    assert "interrupted" in done.stdout, done.stdout + done.stderr
    assert alive == [], done.stdout + done.stderr
