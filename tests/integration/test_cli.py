"""`idem-middleware` against a real database, as an operator runs it (a subprocess)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest

from idem_middleware import sql
from tests.conftest import _fresh_database


def cli(*args: str, dsn: str | None = None, env: dict[str, str] | None = None) -> Any:
    command = [sys.executable, "-m", "idem_middleware.cli"]
    if dsn is not None:
        command += ["--dsn", dsn]
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "IDEM_DATABASE_URL")
    }
    full_env.update(env or {})
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=60, env=full_env
    )


async def insert(pool: Any, key: str, state: str, **columns: Any) -> None:
    final = state in ("succeeded", "failed_final")
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention, expires_at, response_status, lease_expires_at, updated_at) "
        "VALUES ('t', $7, $1, '\\x00', $2, 'lease', interval '1 day', $3, $4, $5, "
        "now() - make_interval(secs => $6))",
        key,
        state,
        columns.get("expires_at") if final else None,
        201 if final else None,
        columns.get("lease_expires_at"),
        float(columns.get("age", 0)),
        columns.get("operation", "POST /payouts"),
    )


async def test_migrate_check_then_apply(admin_dsn: str) -> None:
    dsn = await _fresh_database(admin_dsn, "idem_cli_migrate")
    pending = cli("migrate", "--check", dsn=dsn)
    assert pending.returncode == 1
    versions = [version for version, _, _ in sql.migrations()]
    assert f"pending migrations: {versions}" in pending.stdout
    applied = cli("migrate", env={"IDEM_DATABASE_URL": dsn})  # the DSN from the environment
    assert applied.returncode == 0, applied.stderr
    assert f"applied migrations: {versions}" in applied.stdout
    again = cli("migrate", "--check", dsn=dsn)
    assert again.returncode == 0
    assert "up to date" in again.stdout


async def test_purge_deletes_only_expired_finished_records(db_dsn: str, pool: Any) -> None:
    from datetime import datetime, timedelta

    past = datetime.now(UTC) - timedelta(hours=1)
    future = datetime.now(UTC) + timedelta(hours=1)
    await insert(pool, "old-ok", "succeeded", expires_at=past)
    await insert(pool, "old-failed", "failed_final", expires_at=past)
    await insert(pool, "fresh-ok", "succeeded", expires_at=future)
    await insert(pool, "ancient-pending", "pending", lease_expires_at=past, age=3650 * 86400)
    await insert(pool, "ancient-unknown", "unknown", age=3650 * 86400)
    result = cli("purge", "--batch-size", "1", dsn=db_dsn)
    assert result.returncode == 0, result.stderr
    assert "purged 2 expired records" in result.stdout
    left = {r["idem_key"] for r in await pool.fetch("SELECT idem_key FROM idem_requests")}
    assert left == {"fresh-ok", "ancient-pending", "ancient-unknown"}


async def test_stats_and_list(db_dsn: str, pool: Any) -> None:
    from datetime import datetime, timedelta

    past = datetime.now(UTC) - timedelta(seconds=5)
    await insert(pool, "u1", "unknown", age=120)
    await insert(pool, "p1", "pending", lease_expires_at=past, age=60)
    await insert(pool, "p2", "pending", lease_expires_at=datetime.now(UTC) + timedelta(hours=1))
    stats = cli("stats", "--json", dsn=db_dsn)
    assert stats.returncode == 0, stats.stderr
    data = json.loads(stats.stdout)
    assert data["counts"] == {"pending": 2, "succeeded": 0, "failed_final": 0, "unknown": 1}
    assert 119 <= data["oldest_unresolved_age_seconds"] < 200
    assert data["lapsed_leases"] == 1
    assert set(data["outbox"]) >= {"unsent", "parked", "sent"}
    cheap = cli("stats", "--unresolved", "--json", dsn=db_dsn)
    assert cheap.returncode == 0, cheap.stderr
    data = json.loads(cheap.stdout)
    assert data["counts"] == {"pending": 2, "unknown": 1}  # (finished ones not counted)
    assert data["lapsed_leases"] == 1
    assert 119 <= data["oldest_unresolved_age_seconds"] < 200
    assert "outbox" not in data  # (its counts read it whole)
    text = cli("stats", "--unresolved", dsn=db_dsn).stdout.splitlines()
    assert [line.split()[:2] for line in text] == [
        ["pending", "2"],
        ["unknown", "1"],
        ["lapsed", "leases"],
    ]
    listed = cli("list", "--json", dsn=db_dsn)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["key"] for r in rows] == ["u1", "p1", "p2"]  # oldest first
    stale = cli("list", "--json", "--stale", dsn=db_dsn)
    assert {json.loads(line)["key"] for line in stale.stdout.splitlines()} == {"u1", "p1"}
    only_unknown = cli("list", "--state", "unknown", dsn=db_dsn)
    assert "key=u1" in only_unknown.stdout
    assert "key=p1" not in only_unknown.stdout


async def test_resolve_unknown_with_an_audit_note(db_dsn: str, pool: Any) -> None:
    await insert(pool, "u1", "unknown")
    await insert(pool, "u2", "unknown")
    ok = cli(
        "resolve",
        "--tenant",
        "t",
        "--operation",
        "POST /payouts",
        "--key",
        "u1",
        "--to",
        "succeeded",
        "--status",
        "201",
        "--body",
        '{"ok": true}',
        "--note",
        "bank statement 2026-11-30 shows the transfer",
        dsn=db_dsn,
    )
    assert ok.returncode == 0, ok.stderr
    row = await pool.fetchrow(
        "SELECT state, response_status, response_body, note, expires_at FROM idem_requests "
        "WHERE idem_key = 'u1'"
    )
    assert (row["state"], row["response_status"], bytes(row["response_body"])) == (
        "succeeded",
        201,
        b'{"ok": true}',
    )
    assert row["note"].endswith(
        " resolve unknown -> succeeded 201: bank statement 2026-11-30 shows the transfer"
    )
    assert row["expires_at"] is not None
    retry = cli(
        "resolve",
        "--tenant",
        "t",
        "--operation",
        "POST /payouts",
        "--key",
        "u2",
        "--to",
        "retry",
        "--note",
        "bank has no such transfer",
        dsn=db_dsn,
    )
    assert retry.returncode == 0, retry.stderr
    row = await pool.fetchrow(
        "SELECT state, lease_expires_at, note FROM idem_requests WHERE idem_key = 'u2'"
    )
    assert (row["state"], row["lease_expires_at"]) == ("pending", None)
    assert row["note"].endswith(" resolve unknown -> pending: bank has no such transfer")
    # Only unknown records can be resolved: u1 is settled now.
    again = cli(
        "resolve",
        "--tenant",
        "t",
        "--operation",
        "POST /payouts",
        "--key",
        "u1",
        "--to",
        "retry",
        "--note",
        "x",
        dsn=db_dsn,
    )
    assert again.returncode == 1
    assert "only unknown records" in again.stderr


async def test_reconcile_runs_the_apps_reconcilers(db_dsn: str, pool: Any) -> None:
    from datetime import datetime, timedelta

    await insert(pool, "happened", "unknown")
    await insert(pool, "not-happened", "unknown")
    lapsed = datetime.now(UTC) - timedelta(seconds=1)
    await insert(pool, "lapsed", "pending", lease_expires_at=lapsed)
    # A route whose lapsed leases the client's retry takes over, with no reconciler: left
    # pending for that retry (unknown would refuse it until an operator came).
    await insert(
        pool, "taken-over", "pending", lease_expires_at=lapsed, operation="POST /transfers"
    )
    # A route the app does not show (behind a mount it cannot see into, or another app's on the
    # same database): what it does with a lapsed lease is not known, and `unknown` would wedge
    # a `TAKEOVER` route's key. Left pending, and said so.
    await insert(
        pool, "unseen", "pending", lease_expires_at=lapsed, operation="POST /elsewhere/pay"
    )
    result = cli("reconcile", "--app", "tests.cli_app:app", "--json", dsn=db_dsn)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["left_pending"] == {"POST /elsewhere/pay": 1}
    assert report["expired_leases"] == 1
    assert report["examined"] == 3
    assert report["verdicts"] == {"settled": 1, "not-happened": 1, "still-unknown": 1}
    states = {
        r["idem_key"]: (r["state"], r["response_status"])
        for r in await pool.fetch("SELECT idem_key, state, response_status FROM idem_requests")
    }
    assert states == {
        "happened": ("succeeded", 201),
        "not-happened": ("pending", None),
        "lapsed": ("unknown", None),
        "taken-over": ("pending", None),
        "unseen": ("pending", None),
    }
    text = cli("reconcile", "--app", "tests.cli_app:app", dsn=db_dsn)
    assert "lapsed leases left pending, POST /elsewhere/pay not in --app: 1" in text.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("purge", "--batch-size", "0"),
        ("purge", "--batch-size", "many"),
        ("resolve", "--tenant", "t", "--operation", "o", "--key", "k", "--to", "retry"),
        (
            "resolve",
            "--tenant",
            "t",
            "--operation",
            "o",
            "--key",
            "k",
            "--to",
            "maybe",
            "--note",
            "n",
        ),
        (
            "resolve",
            "--tenant",
            "t",
            "--operation",
            "o",
            "--key",
            "k",
            "--to",
            "succeeded",
            "--note",
            "n",
        ),
        ("list", "--state", "lost"),
        ("reconcile",),
        ("reconcile", "--app", "no-colon"),
        ("frobnicate",),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: tuple[str, ...], db_dsn: str) -> None:
    result = cli(*args, dsn=db_dsn)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "error:" in result.stderr


@pytest.mark.parametrize(
    "url",
    [
        "nonsense",
        "example.com/hook",
        "ftp://example.com/",
        "http://",
        # Each passed as "http with a host" and failed only when sent (or, the first two, ended
        # the command in a traceback).
        "http://[::1",
        "http://[zz]/",
        "http://example.com:99999/",
        "http://example.com:0x/",
        "http://example.com:0/",
        "http://exa mple.com/",
        # (The message never shows the URL: its user part, path or query may be a credential.)
        "ftp://hook:s3cret-pw@example.com/s3cret-path?token=s3cret-tok",
        "http://hook:s3cret-pw@example.com:99999/s3cret-path",
    ],
)
async def test_a_webhook_url_that_cannot_be_sent_to_is_refused_before_any_send(
    url: str, db_dsn: str, pool: Any
) -> None:
    """Before, each send failed (UnsupportedProtocol), its attempt counted, until every due
    event was parked; now nothing is reserved and the command exits 2."""
    from idem_middleware.outbox import add

    async with pool.acquire() as conn, conn.transaction():
        await add(conn, "t", {"n": 1}, event_id="due-1")
    result = cli("outbox", "publish", "--url", url, "--once", dsn=db_dsn)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "is not an http:// or https:// URL" in result.stderr
    assert "s3cret" not in result.stderr
    assert await pool.fetchval("SELECT attempts FROM idem_outbox WHERE event_id = 'due-1'") == 0


async def test_publish_without_httpx_names_the_extra(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    """Installed without the `httpx` extra (the README's install has none), `outbox publish`
    said only "No module named 'httpx'", exit 1, as if it had failed while sending (found by
    probing). It is a usage error naming the extra, and nothing is reserved."""
    from idem_middleware.outbox import add

    (tmp_path / "httpx.py").write_text("raise ModuleNotFoundError(\"No module named 'httpx'\")\n")
    async with pool.acquire() as conn, conn.transaction():
        await add(conn, "t", {"n": 1}, event_id="due-1")
    result = cli(
        "outbox",
        "publish",
        "--url",
        "http://127.0.0.1:9/hook",
        "--once",
        dsn=db_dsn,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "pip install 'idem-middleware[httpx]'" in result.stderr
    assert "Traceback" not in result.stderr
    assert await pool.fetchval("SELECT attempts FROM idem_outbox WHERE event_id = 'due-1'") == 0


@pytest.mark.parametrize(
    ("env", "json_out"),
    [
        ({"IDEM_JSON": "on"}, True),  # before: text (only 1/true/yes counted)
        ({"IDEM_STATS_JSON": "TRUE"}, True),  # before: text (its case counted)
        ({"IDEM_JSON": "off"}, False),
        ({"IDEM_JSON": "2"}, None),  # before: text, silently
        ({"IDEM_STATS_JSON": "json"}, None),
    ],
)
def test_a_flag_variable_reads_as_the_kill_switch_does(
    env: dict[str, str], json_out: bool | None, db_dsn: str
) -> None:
    """On (1, true, yes, on) or off (0, false, no, off, empty), in any case; anything else is a
    usage error naming the variable, not the text a JSON reader then fails on."""
    result = cli("stats", dsn=db_dsn, env=env)
    if json_out is None:
        assert result.returncode == 2, result.stdout
        name, value = next(iter(env.items()))
        assert f"{name}={value!r} is neither on" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("{") is json_out


def test_no_database_is_a_usage_error() -> None:
    result = cli("stats")
    assert result.returncode == 2
    assert "no database" in result.stderr


def test_an_empty_dsn_is_a_usage_error_saying_so_whatever_the_environment_says() -> None:
    result = cli("stats", dsn="", env={"IDEM_DATABASE_URL": "postgresql://h/db"})
    assert result.returncode == 2
    assert "--dsn is empty" in result.stderr


@pytest.mark.parametrize("command", ["migrate", "stats"])
@pytest.mark.parametrize(
    "dsn",
    [
        "nonsense",
        "postgresql://u:pw-secret@h:notaport/db",
        "postgresql://u:pw-secret@127.0.0.1/db?sslmode=bogus",
        "postgresql://u:pw-secret@127.0.0.1:99999/db",
        "postgresql://u:pw-secret@127.0.0.1:-1/db",
    ],
)
def test_a_dsn_that_cannot_be_parsed_is_a_bad_argument(command: str, dsn: str) -> None:
    """Exit 2 with the parser's message, never the password; migrate (and every command, for a
    bad port; a port out of range was still a traceback) showed asyncpg's traceback."""
    result = cli(command, dsn=dsn)
    assert result.returncode == 2, result.stderr
    assert "error: --dsn: " in result.stderr
    assert "Traceback" not in result.stderr
    assert "pw-secret" not in result.stderr + result.stdout


@pytest.mark.parametrize("variable", ["IDEM_DATABASE_URL", "DATABASE_URL"])
@pytest.mark.parametrize("command", ["migrate", "stats"])
def test_a_dsn_from_the_environment_that_cannot_be_parsed_is_named_as_its_variable(
    command: str, variable: str
) -> None:
    """It was told as `--dsn`, which the operator never passed (found by probing)."""
    result = cli(command, env={variable: "postgresql://u:pw-secret@h:notaport/db"})
    assert result.returncode == 2, result.stderr
    assert f"error: {variable}: " in result.stderr
    assert "pw-secret" not in result.stderr + result.stdout


def test_a_blank_idem_database_url_is_unset(db_dsn: str) -> None:
    """Blank, as every other variable: DATABASE_URL is used. It was taken as the DSN, shadowed
    DATABASE_URL, and refused naming neither (found in review)."""
    result = cli("stats", env={"IDEM_DATABASE_URL": " ", "DATABASE_URL": db_dsn})
    assert result.returncode == 0, result.stderr


def test_unreachable_database_exits_1() -> None:
    result = cli("stats", dsn="postgresql://nobody@127.0.0.1:9/none")
    assert result.returncode == 1
    assert result.stderr.startswith("idem-middleware:")


RECORD_ARGS = ("--tenant", "t", "--operation", "POST /payouts", "--key", "k")


@pytest.mark.parametrize(
    "command",
    [
        ("migrate",),
        ("migrate", "--check"),
        ("purge",),
        ("stats",),
        ("list",),
        ("show", *RECORD_ARGS),
        ("reopen", *RECORD_ARGS, "--note", "n"),
        ("outbox", "list"),
    ],
)
@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://nobody:pw-secret@127.0.0.1:9/none",  # nothing listens
        "postgresql://nobody:pw-secret@/none?host=/nonexistent-dir&password=pw-secret",
    ],
)
def test_every_command_that_cannot_connect_says_so_alike(
    command: tuple[str, ...], dsn: str
) -> None:
    """One line, the same for every command, naming the DSN tried without its password.
    `migrate` said only "idem-middleware: [Errno 2] No such file or directory" (it connects
    without the store), and no command named what it tried."""
    result = cli(*command, dsn=dsn)
    assert result.returncode == (2 if "--check" in command else 1), result.stderr  # (not pending)
    shown = dsn.replace(":pw-secret@", "@").replace("password=pw-secret", "password=***")
    assert result.stderr.startswith(f"idem-middleware: cannot connect to {shown}: "), result.stderr
    assert result.stderr.count("\n") == 1
    assert "pw-secret" not in result.stderr + result.stdout


async def test_a_database_that_does_not_exist_cannot_be_connected_to(db_dsn: str) -> None:
    missing = db_dsn.replace("/idem_test", "/idem_no_such_database")
    for command in (("migrate",), ("stats",)):
        result = cli(*command, dsn=missing)
        assert result.returncode == 1
        shown = missing.replace(":@", "@")  # (no password: the empty one is left out too)
        assert result.stderr.startswith(f"idem-middleware: cannot connect to {shown}: ")
        assert 'database "idem_no_such_database" does not exist' in result.stderr


def test_help_names_the_environment_variables() -> None:
    top = cli("--help")
    assert "IDEM_DATABASE_URL" in top.stdout
    purge = cli("purge", "--help")
    assert "IDEM_PURGE_BATCH_SIZE" in purge.stdout


ROOT = Path(__file__).resolve().parents[2]


async def test_options_work_after_the_command(admin_dsn: str) -> None:
    dsn = await _fresh_database(admin_dsn, "idem_cli_after")
    result = cli("migrate", "--dsn", dsn, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"applied": [v for v, _, _ in sql.migrations()]}
    # Before the command still works, and a later --json does not undo an earlier --dsn.
    check = cli("--dsn", dsn, "migrate", "--check", "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout) == {"pending": []}


def test_missing_database_names_every_variable() -> None:
    result = cli("stats")
    assert result.returncode == 2
    assert "IDEM_DATABASE_URL" in result.stderr
    assert "DATABASE_URL (in that order)" in result.stderr


def test_database_url_is_honoured(db_dsn: str) -> None:
    result = cli("stats", "--json", env={"DATABASE_URL": db_dsn})
    assert result.returncode == 0, result.stderr
    assert "counts" in json.loads(result.stdout)


def test_reconcile_imports_the_app_from_the_current_directory(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    (tmp_path / "payouts_app.py").write_text((ROOT / "tests" / "cli_app.py").read_text())
    # -P: the current directory is not put on sys.path by Python itself (as for the console
    # script); PYTHONPATH finds this worktree's package.
    result = subprocess.run(
        [
            *(sys.executable, "-P", "-m", "idem_middleware", "--dsn", db_dsn, "reconcile"),
            *("--app", "payouts_app:app", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["examined"] == 0


@pytest.mark.parametrize(
    ("app", "message"),
    [
        ("no_such_module_here:app", "cannot import 'no_such_module_here'"),
        ("tests.cli_app:nothing", "has no 'nothing'"),
        (":app", "is not module:attribute"),
        # Not an app: before, a silent "examined 0" (its reconcilers never ran) ...
        ("os:path", "module is not a Starlette or FastAPI app"),
        # ... or a factory that cannot be called: before, a traceback.
        ("json:loads", "calling 'loads' failed: TypeError"),
        # ... or an async factory: before, "not a Starlette or FastAPI app", and Python's
        # warning of a coroutine never awaited (found by probing).
        ("tests.cli_app:async_factory", "'async_factory' is an async factory; name the app"),
    ],
)
def test_a_bad_app_reference_is_a_message_and_status_2(app: str, message: str, db_dsn: str) -> None:
    result = cli("reconcile", "--app", app, dsn=db_dsn)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "never awaited" not in result.stderr


async def test_resolve_takes_the_key_quoted_as_the_client_sent_it(db_dsn: str, pool: Any) -> None:
    await insert(pool, "payout-1", "unknown")
    await insert(pool, 'say "hi"', "unknown")
    for quoted in ('"payout-1"', r'"say \"hi\""'):
        result = cli(
            "resolve",
            *("--tenant", "t", "--operation", "POST /payouts", "--key", quoted),
            *("--to", "retry", "--note", "no transfer at the bank"),
            dsn=db_dsn,
        )
        assert result.returncode == 0, result.stderr
    states = {r["idem_key"]: r["state"] for r in await pool.fetch("SELECT * FROM idem_requests")}
    assert states == {"payout-1": "pending", 'say "hi"': "pending"}
    broken = cli(
        "show", "--tenant", "t", "--operation", "POST /payouts", "--key", '"open', dsn=db_dsn
    )
    assert broken.returncode == 2
    assert "not a valid structured-field string" in broken.stderr


async def test_every_command_speaks_json(db_dsn: str, pool: Any) -> None:
    await insert(pool, "u1", "unknown")
    await insert(pool, "u2", "unknown")
    await pool.execute(
        "INSERT INTO idem_outbox (event_id, topic, payload, parked_at)"
        " VALUES ('p', 't', '{}', now())"
    )
    record = ("--tenant", "t", "--operation", "POST /payouts")
    runs = [
        ("migrate", "--check"),
        ("migrate",),
        ("purge",),
        ("stats",),
        ("list",),
        ("show", *record, "--key", "u1"),
        ("resolve", *record, "--key", "u1", "--to", "succeeded", "--status", "201"),
        ("reopen", *record, "--key", "u1"),
        ("resolve", *record, "--key", "u2", "--to", "retry"),
        ("reconcile", "--app", "tests.cli_app:app"),
        ("outbox", "list"),
        ("outbox", "requeue", "p"),
    ]
    for args in runs:
        note = ("--note", "checked") if args[0] in ("resolve", "reopen") else ()
        result = cli(*args, *note, "--json", dsn=db_dsn)
        assert result.returncode == 0, (args, result.stderr)
        for line in result.stdout.splitlines():
            assert isinstance(json.loads(line), dict), (args, line)


async def test_an_empty_list_says_so(db_dsn: str, pool: Any) -> None:
    result = cli("list", dsn=db_dsn)
    assert result.returncode == 0
    assert result.stdout.strip() == "no records in state pending or unknown"
    scoped = cli("list", "--state", "pending", "--tenant", "t", "--stale", dsn=db_dsn)
    assert scoped.stdout.strip() == "no stale records in state pending, tenant t"
    assert cli("list", "--json", dsn=db_dsn).stdout == ""  # JSON lines: none
    assert cli("outbox", "list", dsn=db_dsn).stdout.strip() == "no unsent events"


async def test_list_into_a_closed_pipe_ends_quietly(db_dsn: str, pool: Any) -> None:
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention) SELECT 't', 'POST /payouts', 'k' || i, '\\x00', 'unknown', 'lease', "
        "interval '1 day' FROM generate_series(1, 3000) i"
    )
    first, status, stderr = _first_line_then_close(db_dsn)
    assert status == 0, stderr
    assert first.startswith(b"tenant=t")
    assert stderr == ""


def _first_line_then_close(dsn: str) -> tuple[bytes, int, str]:
    """`idem-middleware list | head -1`: read one line, then close the pipe."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "IDEM_DATABASE_URL")}
    with subprocess.Popen(
        [sys.executable, "-m", "idem_middleware", "--dsn", dsn, "list", "--limit", "3000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as reader:
        assert reader.stdout is not None
        assert reader.stderr is not None
        first = reader.stdout.readline()
        reader.stdout.close()
        stderr = reader.stderr.read().decode()
        return first, reader.wait(timeout=60), stderr


def test_version_and_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "idem_middleware", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("idem-middleware ")


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help_naming_its_environment_variable() -> None:
    from idem_middleware.cli import _parser

    missing = [
        f"{parser.prog} {action.dest}"
        for parser in _parsers(_parser())
        for action in parser._actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert missing == []
    helps = {
        f"{parser.prog} {action.option_strings[0]}": action.help or ""
        for parser in _parsers(_parser())
        for action in parser._actions
        if action.option_strings
    }
    for option, env in [
        ("idem-middleware --dsn", "IDEM_DATABASE_URL, then DATABASE_URL"),
        ("idem-middleware migrate --dsn", "IDEM_DATABASE_URL"),
        ("idem-middleware list --json", "IDEM_JSON"),
        ("idem-middleware list --tenant", "IDEM_TENANT"),
        ("idem-middleware outbox publish --url", "IDEM_OUTBOX_URL"),
        ("idem-middleware reconcile --app", "IDEM_APP"),
    ]:
        assert env in helps[option], option


@pytest.fixture
def one_server_bouncer(pg_dsn: str, db_dsn: str) -> Iterator[Any]:
    """PgBouncer in transaction mode with one server connection, kept while idle: each command
    gets the server session the one before it used, as a busy production bouncer hands out."""
    from tests.pgbouncer import PgBouncer, binary

    if binary() is None:
        pytest.skip("pgbouncer is not installed (apt-get install -y pgbouncer)")
    bouncer = PgBouncer(pg_dsn, pool_size=1, server_idle_timeout=600).start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


async def test_every_command_runs_again_and_again_through_pgbouncer(
    one_server_bouncer: Any, pool: Any
) -> None:
    """The commands name no prepared statements: behind PgBouncer in transaction mode a server
    session outlives the command that prepared on it, and asyncpg's `__asyncpg_stmt_1__` of the
    previous command made every later one fail with "already exists"."""
    dsn = one_server_bouncer.dsn("idem_test")
    await insert(pool, "u1", "unknown")
    record = ("--tenant", "t", "--operation", "POST /payouts")
    runs = [
        ("migrate",),
        ("migrate",),
        ("migrate", "--check"),
        ("stats",),
        ("stats",),
        ("list",),
        ("show", *record, "--key", "u1"),
        ("resolve", *record, "--key", "u1", "--to", "succeeded", "--status", "201"),
        ("reopen", *record, "--key", "u1"),
        ("purge",),
        ("outbox", "list"),
        ("outbox", "list"),
    ]
    for args in runs:
        note = ("--note", "checked") if args[0] in ("resolve", "reopen") else ()
        result = cli(*args, *note, dsn=dsn)
        assert result.returncode == 0, (args, result.stderr)
    assert await pool.fetchval("SELECT state FROM idem_requests WHERE idem_key = 'u1'") == "unknown"


LIFESPAN_APP = """
import contextlib, pathlib, sys
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, idempotent
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation

BANK = {}  # what the lifespan opens: the reconciler's way to the downstream system
MARKS = pathlib.Path(__file__).with_name("marks.txt")


async def reconcile(ctx: ReconcileContext) -> Reconciliation:
    return Happened.json(201, {"bank": BANK["client"]})  # KeyError without the lifespan


@idempotent(mode=Mode.LEASE, reconciler=reconcile)
async def payouts(request):
    return JSONResponse({}, status_code=201)


@contextlib.asynccontextmanager
async def lifespan(app):
    BANK["client"] = "open"
    yield
    MARKS.write_text("shut down")


app = Starlette(
    routes=[Route("/payouts", payouts, methods=["POST"])],
    middleware=[
        Middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t")
    ],
    lifespan=lifespan,
)
"""


async def test_reconcile_runs_the_apps_lifespan_around_its_reconcilers(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    """A reconciler that asks its bank through a client the app's lifespan opens. The command
    ran no lifespan: every such reconciler raised, each record counted `failed` and stayed
    unknown (the test suite's own lease app, whose reconciler reads the app's store, too)."""
    (tmp_path / "lifespan_app.py").write_text(LIFESPAN_APP)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    await insert(pool, "skipped", "unknown")
    skipped = cli(
        "reconcile", "--app", "lifespan_app:app", "--no-lifespan", "--json", dsn=db_dsn, env=env
    )
    assert skipped.returncode == 0, skipped.stderr
    assert json.loads(skipped.stdout)["verdicts"] == {"failed": 1}
    assert not (tmp_path / "marks.txt").exists()

    result = cli("reconcile", "--app", "lifespan_app:app", "--json", dsn=db_dsn, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdicts"] == {"settled": 1}
    row = await pool.fetchrow("SELECT state, response_body FROM idem_requests")
    assert row["state"] == "succeeded"
    assert json.loads(bytes(row["response_body"])) == {"bank": "open"}
    assert (tmp_path / "marks.txt").read_text() == "shut down"


@pytest.mark.parametrize(
    "failure",
    [
        'raise RuntimeError("no bank")',
        # (asyncio lets these two out of the event loop: a traceback, exit status 1)
        'sys.exit("no bank")',
        'raise KeyboardInterrupt("no bank")',
    ],
)
def test_an_app_whose_lifespan_fails_is_a_message_and_status_2(
    db_dsn: str, tmp_path: Path, failure: str
) -> None:
    failing = LIFESPAN_APP.replace('BANK["client"] = "open"', failure)
    (tmp_path / "failing_app.py").write_text(failing)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    result = cli("reconcile", "--app", "failing_app:app", dsn=db_dsn, env=env)
    assert result.returncode == 2, result.stderr
    assert "lifespan's startup failed" in result.stderr
    assert "no bank" in result.stderr
    assert "--no-lifespan" in result.stderr
    assert "never retrieved" not in result.stderr  # (asyncio's, of a task the loop let out)


async def test_purge_says_when_it_stopped_at_its_limit_with_records_left(
    db_dsn: str, pool: Any
) -> None:
    """Found by probing at scale: at its defaults purge deletes at most a million records a run
    and said only how many it deleted, so a purge run hourly under more than 280 requests a
    second fell further behind every hour with nothing to show it."""
    from datetime import datetime, timedelta

    past = datetime.now(UTC) - timedelta(hours=1)
    for key in ("old-1", "old-2", "old-3"):
        await insert(pool, key, "succeeded", expires_at=past)
    limited = cli("purge", "--batch-size", "1", "--max-batches", "2", dsn=db_dsn)
    assert limited.returncode == 0, limited.stderr
    assert "purged 2 expired records" in limited.stdout
    assert "stopped at --max-batches (2 batches of 1)" in limited.stderr
    rest = cli("--json", "purge", "--batch-size", "2", "--max-batches", "2", dsn=db_dsn)
    assert json.loads(rest.stdout) == {"purged": 1, "stopped_at_limit": False}
    assert rest.stderr == ""


@pytest.mark.parametrize(
    "args",
    [
        ("stats",),
        ("stats", "--json"),
        ("list",),
        ("show", "--tenant", "t", "--operation", "POST /payouts", "--key", "closed-out"),
        ("reconcile", "--app", "tests.cli_app:app", "--no-lifespan"),
        (
            "resolve",
            "--tenant",
            "t",
            "--operation",
            "POST /payouts",
            "--key",
            "closed-out",
            "--to",
            "failed_final",
            "--status",
            "402",
            "--note",
            "declined",
        ),
    ],
    ids=lambda args: args[0] + ("-json" if "--json" in args else ""),
)
async def test_a_closed_standard_output_does_nothing_and_says_so(
    db_dsn: str, pool: Any, args: tuple[str, ...]
) -> None:
    """`idem-middleware stats >&-`: found by probing, every command ran (a `resolve` settled its
    record, a `reconcile` ran its reconcilers), printed nothing, and then failed with a
    traceback (`'NoneType' object has no attribute 'flush'`) and status 1, so the operator could
    not tell whether it had acted. Now it does nothing and says why, on stderr."""
    await insert(pool, "closed-out", "unknown")
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "IDEM_DATABASE_URL")}
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "idem_middleware", "--dsn", db_dsn, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        env=env,
        preexec_fn=lambda: os.close(1),  # (as the shell's `>&-`)
    )
    assert result.returncode == 1
    assert result.stderr == "idem-middleware: standard output is closed; nothing was done\n"
    state = await pool.fetchval("SELECT state FROM idem_requests WHERE idem_key = 'closed-out'")
    assert state == "unknown"
