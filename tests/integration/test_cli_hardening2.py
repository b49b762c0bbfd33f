"""Operator command-line defects found by probing, each fixed and kept fixed: a reconcile limit
past a million that did nothing, two operators' corrections of one record of which one was lost,
a `resolve` killed while it waited that landed later, a body that was not UTF-8, a purge refused
partway that did not say what it had done, a publisher Ctrl-C could not stop mid-send, and two
smaller ones (a lock timeout the server refuses, a key that forged a field of `list`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from idem_middleware import cli_commands
from idem_middleware.errors import RetryableConflict, StatementRefused, StoreError
from idem_middleware.ops import Resolution, ResolveError, resolve
from idem_middleware.store.base import RecordKey, Settlement, State, StoredResponse
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_cli import cli, insert

OPERATION = "POST /payouts"
RECORD = ("--tenant", "t", "--operation", OPERATION)


def _popen(*args: str, dsn: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "IDEM_DATABASE_URL")}
    return subprocess.Popen(
        [sys.executable, "-m", "idem_middleware.cli", "--dsn", dsn, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


async def _held(pool: Any, key: str) -> tuple[Any, Any]:
    """A connection holding the row of `key` in an open transaction (a reconciler's fence, a
    request's): (connection, transaction); roll back and release both."""
    conn = await pool.acquire()
    transaction = conn.transaction()
    await transaction.start()
    await conn.execute("SELECT 1 FROM idem_requests WHERE idem_key = $1 FOR UPDATE", key)
    return conn, transaction


async def _waiting_on_a_lock(pool: Any, seconds: float = 10.0) -> None:
    """Until a session waits for a row lock (the statement under test reached the server)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        waiting = await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"
        )
        if waiting:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no session came to wait for the row")


async def _trail(pool: Any, key: str) -> tuple[str, list[str]]:
    row = await pool.fetchrow("SELECT state, note FROM idem_requests WHERE idem_key = $1", key)
    return row["state"], [] if row["note"] is None else row["note"].splitlines()


# -- 1. reconcile --limit past a million ------------------------------------------------------


@pytest.mark.parametrize("limit", ["1000001", "2147483647"])
async def test_reconcile_with_a_limit_past_a_million_does_its_work(
    db_dsn: str, pool: Any, limit: str
) -> None:
    """Every limit from 1,000,001 to the largest the option takes did nothing and exited 0,
    "examined 0": the first window was the limit itself, past the most a run looks at."""
    await insert(pool, "happened", "unknown")
    lapsed = datetime.now(UTC) - timedelta(seconds=1)
    await insert(pool, "lapsed", "pending", lease_expires_at=lapsed)
    result = cli("reconcile", "--app", "tests.cli_app:app", "--limit", limit, "--json", dsn=db_dsn)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["expired_leases"] == 1
    assert report["examined"] == 2
    assert report["verdicts"] == {"settled": 1, "still-unknown": 1}


# -- 2. two operators re-resolving one record at once ------------------------------------------


async def test_two_operators_re_resolving_one_record_at_once_cannot_both_land(
    pg_store: PostgresStore, pool: Any
) -> None:
    """Both were told "resolved": a re-resolve leaves the state as it was, and the amend's
    compare-and-set looked at the generation and the state alone, so the second landed on the
    first, whose correction was lost with no word to either (and the trail showed the second
    moving from the first's reading). Now one lands and the other is told the record changed."""
    await insert(pool, "twice", "succeeded", expires_at=datetime.now(UTC) + timedelta(days=1))
    key = RecordKey("t", OPERATION, "twice")
    conn, transaction = await _held(pool, "twice")
    try:
        moves = [
            asyncio.ensure_future(
                resolve(
                    pg_store,
                    key,
                    Resolution.SUCCEEDED,
                    note=f"{who}: the bank says {status}",
                    response=StoredResponse(status, [], b""),
                    again=True,
                )
            )
            for who, status in (("A", 200), ("B", 202))
        ]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # both read the record and wait for its row
            waiting = await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
            if waiting == 2:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the two moves did not both come to wait for the row")
    finally:
        await transaction.rollback()
        await pool.release(conn)
    outcomes = await asyncio.gather(*moves, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(refused) == 1, outcomes
    assert isinstance(refused[0], ResolveError)
    assert "changed while it was being resolved" in str(refused[0])
    landed = [o for o in outcomes if not isinstance(o, BaseException)]
    status = landed[0].status
    state, trail = await _trail(pool, "twice")
    assert state == "succeeded"
    assert len(trail) == 1
    assert trail[0].split(" ", 1)[1].startswith(f"re-resolve succeeded 201 -> succeeded {status}")
    stored = await pool.fetchval("SELECT response_status FROM idem_requests WHERE idem_key='twice'")
    assert stored == status


async def test_a_move_made_from_a_stale_reading_is_refused_after_any_other_move(
    pg_store: PostgresStore, pool: Any
) -> None:
    """Each move to an outcome takes a new generation, so no (generation, state) read before
    another operator's move is matched after it, whichever moves were made."""
    await insert(pool, "stale", "succeeded", expires_at=datetime.now(UTC) + timedelta(days=1))
    key = RecordKey("t", OPERATION, "stale")
    read = await pg_store.describe(key)
    assert read is not None
    ok = StoredResponse(200, [], b"")
    assert await pg_store.amend(key, read.generation, read.state, Settlement(State.SUCCEEDED, ok))
    stale = Settlement(State.SUCCEEDED, StoredResponse(202, [], b""), note="stale")
    assert not await pg_store.amend(key, read.generation, read.state, stale)
    assert not await pg_store.amend(key, read.generation, read.state, Settlement(State.UNKNOWN))


# -- 3. a resolve stopped while it waited ------------------------------------------------------


async def test_a_resolve_terminated_while_it_waits_is_not_applied_later(
    db_dsn: str, pool: Any
) -> None:
    """Killed by SIGTERM (`timeout`, systemd) while its UPDATE waited for a row another session
    held, the process died, and the server applied the UPDATE once the row was free: the record
    was resolved after the operator had been told nothing."""
    await insert(pool, "term", "unknown")
    conn, transaction = await _held(pool, "term")
    try:
        resolving = _popen(
            "resolve", *RECORD, "--key", "term", "--to", "succeeded", "--status", "200",
            "--note", "from a script with a timeout", dsn=db_dsn,
        )  # fmt: skip
        await _waiting_on_a_lock(pool)
        resolving.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(resolving.communicate, timeout=30)
    finally:
        await transaction.rollback()
        await pool.release(conn)
    await asyncio.sleep(0.5)
    assert await _trail(pool, "term") == ("unknown", [])  # (it was succeeded, unsaid)
    assert resolving.returncode == 143, err
    assert "terminated" in err
    assert "Traceback" not in err


async def test_an_operators_move_waits_for_a_held_row_a_bounded_time_on_the_server(
    pg_store: PostgresStore, pool: Any
) -> None:
    """The amend's own bound, for a client lost without a word (killed outright, its network
    gone): the server gives the statement up, never to land once the row is free."""
    await insert(pool, "bound", "unknown")
    key = RecordKey("t", OPERATION, "bound")
    read = await pg_store.describe(key)
    assert read is not None
    conn, transaction = await _held(pool, "bound")
    try:
        started = time.monotonic()
        settlement = Settlement(State.SUCCEEDED, StoredResponse(200, [], b""), note="late")
        with pytest.raises(StoreError, match="lock_timeout"):
            async with asyncio.timeout(15):  # (it waited for as long as the row was held)
                await pg_store.amend(key, read.generation, State.UNKNOWN, settlement)
        assert 5.0 < time.monotonic() - started < 9.0
    finally:
        await transaction.rollback()
        await pool.release(conn)
    assert await _trail(pool, "bound") == ("unknown", [])


# -- 4. a body that is not UTF-8 ---------------------------------------------------------------


@pytest.mark.parametrize("option", ["--body", "--content-type"])
def test_a_body_or_content_type_that_is_not_utf8_is_a_usage_error(db_dsn: str, option: str) -> None:
    """`--body` with bytes that are not UTF-8 (read as lone surrogates) printed a traceback."""
    given = {"--body": "{}", "--content-type": "application/json", option: "caf\udce9"}
    result = cli(
        "resolve", *RECORD, "--key", "k", "--to", "succeeded", "--status", "200", "--note", "n",
        "--body", given["--body"], "--content-type", given["--content-type"], dsn=db_dsn,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"argument {option}: b'caf\\xe9' is not UTF-8 text" in result.stderr
    assert "Traceback" not in result.stderr


# -- 5. a purge the database refuses partway ---------------------------------------------------


class _RefusedAfter:
    """A store whose purge commits batches of `deleted` rows, then is refused by the server (as
    a role without DELETE on idem_tokens is, once the records are gone)."""

    def __init__(self, deleted: int) -> None:
        self.deleted = deleted

    async def purge(self, *, progress: Any, **limits: Any) -> int:
        progress(self.deleted)
        raise asyncpg.InsufficientPrivilegeError("permission denied for table idem_tokens")


@pytest.mark.parametrize("as_json", [False, True])
async def test_a_purge_refused_partway_says_what_it_deleted(
    as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain database error (not a StoreError) escaped: the bare server message, not what had
    been deleted and committed, and nothing at all on stdout with --json."""
    store: Any = _RefusedAfter(5)
    args = argparse.Namespace(command="purge", json=as_json, batch_size=1000, max_batches=1000)
    with pytest.raises(cli_commands.Interrupted) as stopped:
        await cli_commands.purge(store, args)
    message = str(stopped.value)
    assert message.startswith("purge stopped after deleting 5 expired records"), message
    assert message.endswith("permission denied for table idem_tokens")
    # (Running it again as it is would fail alike: the operator is told to fix it first.)
    assert "fix what failed (below), then run it again" in message
    if as_json:
        report = json.loads(capsys.readouterr().out)
        assert report == {
            "purged": 5,
            "stopped_at_limit": False,
            "error": "permission denied for table idem_tokens",
        }


@pytest.mark.parametrize(
    ("error", "advice"),
    [
        (StoreError("connection lost"), "run it again"),
        (RetryableConflict("deadlock detected"), "run it again"),
        (asyncpg.DeadlockDetectedError("deadlock detected"), "run it again"),
        (asyncpg.QueryCanceledError("statement timeout"), "run it again"),
        (asyncpg.InsufficientPrivilegeError("permission denied"), "fix what failed (below)"),
        (StatementRefused("UndefinedTableError: no idem_tokens"), "fix what failed (below)"),
    ],
)
async def test_a_purge_stopped_partway_says_whether_running_it_again_can_pass(
    error: Exception, advice: str
) -> None:
    """A lost connection, a conflict or a timeout may pass on the next run; a refusal fails the
    same way until it is fixed (it said "run it again" for every error)."""

    class Stops:
        async def purge(self, *, progress: Any, **limits: Any) -> int:
            progress(2)
            raise error

    args = argparse.Namespace(command="purge", json=False, batch_size=1000, max_batches=1000)
    with pytest.raises(cli_commands.Interrupted) as stopped:
        await cli_commands.purge(Stops(), args)  # type: ignore[arg-type]
    assert f"(each batch is committed; {advice}" in str(stopped.value)


async def test_a_purge_refused_partway_by_the_server_exits_1_saying_so(
    db_dsn: str, pool: Any
) -> None:
    """The same through the command line, as a role without DELETE on idem_tokens."""
    past = datetime.now(UTC) - timedelta(hours=1)
    for i in range(3):
        await insert(pool, f"old{i}", "succeeded", expires_at=past)
    role = f"idem_no_token_delete_{os.getpid()}"
    await pool.execute(f"CREATE ROLE {role} LOGIN")
    try:
        await pool.execute(
            f"GRANT USAGE ON SCHEMA public TO {role}; "
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON idem_requests TO {role}; "
            f"GRANT SELECT, UPDATE ON idem_tokens TO {role}; "
            f"GRANT SELECT ON idem_lock_secret, idem_schema_migrations TO {role}; "
            f"GRANT SELECT, INSERT, DELETE ON idem_waiters TO {role}; "
            f"GRANT USAGE ON SEQUENCE idem_generation_seq TO {role}"
        )
        parts = urlsplit(db_dsn)
        host = parts.netloc.rsplit("@", 1)[-1]
        result = cli("purge", "--json", dsn=urlunsplit(parts._replace(netloc=f"{role}@{host}")))
    finally:
        await pool.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["purged"] == 3
    assert "idem_tokens" in report["error"]
    assert "purge stopped after deleting 3 expired records" in result.stderr
    assert "fix what failed (below), then run it again" in result.stderr
    assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 0


# -- 6. outbox publish: Ctrl-C twice -----------------------------------------------------------


@pytest.fixture
def silent_webhook() -> Iterator[int]:
    """A listener that accepts connections and never answers; its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[Any] = []

    def accept() -> None:
        for _ in range(1_000):  # (the tests make a few connections)
            try:
                held.append(server.accept())
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        # (A close alone leaves accept() blocked, and the thread with it, for the rest of the
        # run: shutting the socket down wakes it.)
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        thread.join(5)
        assert not thread.is_alive(), "the listener's thread is still in accept()"
        server.close()
        for conn, _ in held:
            conn.close()


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
async def test_a_second_ctrl_c_stops_a_publisher_stuck_in_a_send(
    db_dsn: str, pool: Any, silent_webhook: int, stop: signal.Signals, code: int
) -> None:
    """The first SIGINT waits for the batch under way; the second was ignored too, and the
    publisher went on waiting for --send-timeout (up to 100 years) on a webhook that never
    answers. Now the second stops it at once, exit 130; two SIGTERMs (a supervisor's stop,
    then its kill timeout sent as SIGTERM again) exit 143, as any command SIGTERM stops."""
    from idem_middleware import outbox

    async with pool.acquire() as conn:
        await outbox.add(conn, "topic", {"n": 1}, event_id="ctrl-c")
    url = f"http://127.0.0.1:{silent_webhook}/hook"
    publishing = _popen("outbox", "publish", "--url", url, "--send-timeout", "60", dsn=db_dsn)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the send is under way once the event is reserved
            attempts = await pool.fetchval(
                "SELECT next_attempt_at > now() FROM idem_outbox WHERE event_id = 'ctrl-c'"
            )
            if attempts:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        publishing.send_signal(stop)
        await asyncio.sleep(0.5)
        assert publishing.poll() is None  # the first waits for the send
        started = time.monotonic()
        publishing.send_signal(stop)
        _, err = await asyncio.to_thread(publishing.communicate, timeout=20)
    finally:
        if publishing.poll() is None:
            publishing.kill()
            publishing.communicate()
    assert publishing.returncode == code, err
    assert time.monotonic() - started < 10
    assert "stopped at once" in err
    assert "Traceback" not in err


# -- 7. the small ones -------------------------------------------------------------------------


def test_a_lock_timeout_the_server_refuses_is_a_usage_error(db_dsn: str) -> None:
    """Up to 100 years were taken, and the server refused more than 2**31 - 1 ms after the
    command had connected and waited for the migrators' lock (exit 1)."""
    result = cli("migrate", "--lock-timeout", "3000000", dsn=db_dsn)
    assert result.returncode == 2, result.stderr
    assert "argument --lock-timeout" in result.stderr
    assert "longest lock_timeout" in result.stderr
    fine = cli("migrate", "--check", "--lock-timeout", "2147483.647", dsn=db_dsn)
    assert fine.returncode == 0, fine.stderr


async def test_a_key_cannot_forge_a_field_of_lists_text(db_dsn: str, pool: Any) -> None:
    """Fields are `name=value` two spaces apart: a key `x  state=succeeded` showed an unknown
    record as `key=x  state=succeeded  state=unknown`. A value that could read as a field of its
    own is quoted (`--json` gives the values exactly)."""
    await insert(pool, "x  state=succeeded", "unknown")
    result = cli("list", dsn=db_dsn)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert 'key="x  state=succeeded"' in line
    assert "operation=POST /payouts" in line  # (one space reads as no field: left as it was)
    fields = [f for f in line.split("  ") if not f.startswith('state=succeeded"')]
    assert [f for f in fields if f.startswith("state=")] == ["state=unknown"]
