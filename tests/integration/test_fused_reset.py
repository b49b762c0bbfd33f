"""The reset of a handler's connection, sent after the COMMIT in the message that commits
(store/postgres/fused.py): the session state a handler leaves is gone before anyone else gets the
connection, and an error in that message is told apart from a failed COMMIT by the record."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from idem_middleware.errors import StoreError
from idem_middleware.store.postgres.fused import _recorded, _utf8
from tests.apps import BearerBackend, QueryLog, client, key, logged_store

_RESET = "SELECT pg_advisory_unlock_all()"


async def _connection(request: Request) -> Any:
    ctx = get_context(request)
    return await ctx.fenced_connection() if ctx.mode is Mode.LEASE else ctx.connection


async def messy(request: Request) -> Response:
    """Leaves every kind of session state the reset query clears: a setting, a session-level
    advisory lock, a LISTEN and a cursor held past the commit."""
    conn = await _connection(request)
    await conn.execute("SET application_name = 'left-by-the-handler'")
    await conn.execute("SELECT pg_advisory_lock(4242)")
    await conn.execute("LISTEN left_by_the_handler")
    await conn.execute("DECLARE left_open CURSOR WITH HOLD FOR SELECT 1")
    await conn.execute("INSERT INTO reset_child (parent) VALUES (1)")
    return JSONResponse({"ok": True}, status_code=201)


async def orphan(request: Request) -> Response:
    """A write whose (deferred) foreign key fails only at COMMIT."""
    conn = await _connection(request)
    await conn.execute("INSERT INTO reset_child (parent) VALUES (999)")
    return JSONResponse({"ok": True}, status_code=201)


def _app(store: PostgresStore, mode: Mode) -> Starlette:
    return Starlette(
        routes=[
            Route("/messy", messy, methods=["POST"]),
            Route("/orphan", orphan, methods=["POST"]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=Policy(mode=mode)),
        ],
    )


@pytest.fixture
async def tables(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS reset_parent (id int PRIMARY KEY);"
            "CREATE TABLE IF NOT EXISTS reset_child (parent int REFERENCES reset_parent "
            "DEFERRABLE INITIALLY DEFERRED);"
            "TRUNCATE reset_child, reset_parent, idem_requests;"
            "INSERT INTO reset_parent VALUES (1)"
        )
    finally:
        await conn.close()


async def _children(db_dsn: str) -> int:
    conn = await asyncpg.connect(db_dsn)
    try:
        n: int = await conn.fetchval("SELECT count(*) FROM reset_child")
        return n
    finally:
        await conn.close()


@pytest.mark.usefixtures("tables")
@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_what_a_handler_leaves_on_its_connection_is_gone_when_it_commits(
    db_dsn: str, mode: Mode
) -> None:
    log = QueryLog()
    async with logged_store(db_dsn, log) as store, client(_app(store, mode)) as c:
        r = await c.post("/messy", json={}, headers=key(f"messy-{mode}"))
        await asyncio.sleep(0)  # (asyncpg calls its query loggers soon after, not at once)
        commits = [q for q in log.queries if q.startswith("EXECUTE") and "COMMIT" in q]
        assert len(commits) == 1
        assert _RESET in commits[0]
        assert not any(q.startswith(_RESET) for q in log.queries)  # no round trip of its own
        async with store.pool.acquire() as conn:  # the same, only connection
            state = await conn.fetchrow(
                "SELECT current_setting('application_name') AS name,"
                " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                "  AND pid = pg_backend_pid()) AS locks,"
                " (SELECT count(*) FROM pg_listening_channels()) AS channels,"
                " (SELECT count(*) FROM pg_cursors WHERE name = 'left_open') AS cursors"
            )
    assert r.status_code == 201
    assert dict(state) == {"name": "idem_middleware", "locks": 0, "channels": 0, "cursors": 0}
    assert await _children(db_dsn) == 1


class _ResetFails(asyncpg.Connection):  # type: ignore[type-arg]
    """A connection whose reset query fails: after the COMMIT in the fused message, and again
    on release (the pool then closes the connection)."""

    def get_reset_query(self) -> str:
        return "SELECT 1 / 0"


@pytest.mark.usefixtures("tables")
@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_reset_failing_after_the_commit_leaves_the_outcome_recorded_and_answered(
    db_dsn: str, mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    log = QueryLog()
    store = logged_store(db_dsn, log, connection_class=_ResetFails)
    caplog.set_level(logging.WARNING, logger="idem_middleware.store")
    async with store, client(_app(store, mode)) as c:
        first = await c.post("/messy", json={}, headers=key(f"reset-fails-{mode}"))
        again = await c.post("/messy", json={}, headers=key(f"reset-fails-{mode}"))
    assert any("SELECT 1 / 0" in q and "COMMIT" in q for q in log.queries)
    assert "reset failed after its commit" in caplog.text
    # Committed once, answered as committed (not as a completion that matched nothing), and
    # replayed to the retry without running the handler again.
    assert first.status_code == 201
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert await _children(db_dsn) == 1


@pytest.mark.usefixtures("tables")
@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_commit_that_fails_with_the_reset_behind_it_is_not_taken_for_done(
    db_dsn: str, mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    log = QueryLog()
    async with logged_store(db_dsn, log) as store:
        async with client(_app(store, mode)) as c:
            r = await c.post("/orphan", json={}, headers=key(f"orphan-{mode}"))
        async with store.pool.acquire() as conn:
            recorded = await conn.fetchval(
                "SELECT state FROM idem_requests WHERE idem_key = $1", f"orphan-{mode}"
            )
    assert any(q.startswith("EXECUTE") and _RESET in q for q in log.queries)  # it was fused
    assert r.status_code >= 500
    assert recorded in (None, "pending", "unknown")  # never the handler's 201
    assert await _children(db_dsn) == 0
    # Logged for what it is (it blamed a SET ROLE or a search_path the handler never made).
    assert "broke a deferred constraint" in caplog.text


@pytest.mark.usefixtures("tables")
async def test_a_lease_settlement_the_database_refuses_leaves_the_record_unknown_at_once(
    db_dsn: str,
) -> None:
    """Found by probing: a fenced settlement the database refused (here a deferred foreign key
    failing at its COMMIT) rolled back, and the record stayed `pending` until its lease lapsed:
    every retry meanwhile was told the request was still running. What the handler did outside
    the database may have happened, so the record is `unknown` at once, as when the handler
    itself raises."""
    log = QueryLog()
    k = key("orphan-unknown")
    async with logged_store(db_dsn, log) as store, client(_app(store, Mode.LEASE)) as c:
        first = await c.post("/orphan", json={}, headers=k)
        async with store.pool.acquire() as conn:
            recorded = await conn.fetchval(
                "SELECT state FROM idem_requests WHERE idem_key = $1", k["idempotency-key"]
            )
        again = await c.post("/orphan", json={}, headers=k)
    assert first.status_code >= 500
    assert recorded == "unknown"
    # Told the outcome is unknown (a reconciler or an operator settles it), not "still running".
    assert again.json()["type"].endswith(":outcome-unknown"), again.text
    assert await _children(db_dsn) == 0


async def test_a_settlement_that_keeps_its_state_cannot_be_told_committed_by_the_record() -> None:
    """A settlement from a state to the same state leaves nothing the record could show: after
    an error behind its COMMIT, the outcome is unknown (StoreError), never guessed."""
    args = ("t", "POST /x", "k", 7, "unknown", "unknown", None, None, None, None, "n", "tok")
    with pytest.raises(StoreError, match="not known"):
        await _recorded(None, "settle_checked", args, RuntimeError("after the commit"))


class _Settings:
    def __init__(self, client_encoding: object) -> None:
        self.client_encoding = client_encoding


class _Reports:
    def __init__(self, client_encoding: object) -> None:
        self.settings = _Settings(client_encoding)

    def get_settings(self) -> _Settings:
        return self.settings


@pytest.mark.parametrize(
    ("reported", "utf8"),
    [
        ("UTF8", True),
        ("'utf-8'", True),  # PgBouncer passes on asyncpg's own spelling
        ("utf_8", True),
        ("Unicode", True),
        ("LATIN1", False),
        ("SQL_ASCII", False),
        ("'utf-16'", False),
        ("utf8mb4", False),
        (None, False),
    ],
)
def test_the_fast_path_takes_a_client_encoding_as_postgresql_reads_its_name(
    reported: object, utf8: bool
) -> None:
    assert _utf8(_Reports(reported)) is utf8
