"""What a handler does to its database session between the claim and the completion: settings,
the session's prepared statements, the transaction itself. The client gets a clear answer, the
record says what happened, nothing runs twice, and the connection comes back to the pool fit for
the next request (the pools here have one connection: whatever a request leaves, the next gets).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from idem_middleware.sqla import open_claim_session
from tests.apps import LEDGER_INSERT, BearerBackend, QueryLog, client, count, key, logged_store


async def _connection(request: Request) -> Any:
    ctx = get_context(request)
    return await ctx.fenced_connection() if ctx.mode is Mode.LEASE else ctx.connection


_THEN = {"deallocate": "DEALLOCATE ALL", "commit": "COMMIT", "rollback": "ROLLBACK"}
_SQLA_INSERT = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES (:tenant, 'handler', 1)"


async def write(request: Request) -> Response:
    """One ledger row (a statement asyncpg prepares and caches on the connection; `?by=group`:
    in a task of a TaskGroup, `?by=sqla`: through a SQLAlchemy claim session), then the
    statements the query string names (`?then=deallocate`)."""
    ctx = get_context(request)
    conn = await _connection(request)
    by = request.query_params.get("by")
    if by == "sqla":
        async with open_claim_session(request) as session:
            await session.execute(text(_SQLA_INSERT), {"tenant": ctx.tenant})
    elif by == "group":
        async with asyncio.TaskGroup() as group:
            group.create_task(conn.execute(LEDGER_INSERT, ctx.tenant, "handler", 1))
    else:
        await conn.execute(LEDGER_INSERT, ctx.tenant, "handler", 1)
    then = request.query_params.get("then")
    if then is not None:
        await conn.execute(_THEN[then])
    return JSONResponse({"ok": True}, status_code=201)


def _app(store: PostgresStore, mode: Mode) -> Starlette:
    return Starlette(
        routes=[Route("/write", write, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=Policy(mode=mode)),
        ],
    )


async def _state(pool: Any, idem_key: str) -> str | None:
    state: str | None = await pool.fetchval(
        "SELECT state FROM idem_requests WHERE idem_key = $1", idem_key
    )
    return state


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_handler_dropping_the_sessions_prepared_statements_harms_no_later_request(
    db_dsn: str, pool: Any, mode: Mode
) -> None:
    """`DEALLOCATE ALL` drops asyncpg's cached statements (and the fast path's) from the
    session while asyncpg still names them: every later statement of theirs on that connection
    failed with "prepared statement ... does not exist", a 500 for each later request the pool
    gave it, whatever its handler did, until the process restarted."""
    store = logged_store(db_dsn, QueryLog())
    async with store, client(_app(store, mode)) as c:
        first = await c.post("/write?then=deallocate", json={}, headers=key(f"drop-{mode}"))
        if mode is Mode.TRANSACTIONAL:
            again = await c.post("/write?then=deallocate", json={}, headers=key(f"drop-{mode}"))
            assert again.headers.get("idempotent-replayed") == "true"
        later = [
            await c.post("/write", json={}, headers=key(f"later-{mode}-{i}")) for i in range(3)
        ]
    assert [r.status_code for r in later] == [201, 201, 201], [r.text for r in later]
    for i in range(3):
        assert await _state(pool, f"later-{mode}-{i}") == "succeeded"
    if mode is Mode.TRANSACTIONAL:
        # Its completion found its own statement gone: nothing of it committed, and it ran again
        # (on the next try with no statement to lose), once.
        assert first.status_code == 201, first.text
        assert await _state(pool, f"drop-{mode}") == "succeeded"
    else:
        # The fenced settlement found its statement gone: its writes rolled back, and the
        # record is not claimed to be settled (its downstream call may have been made).
        assert first.status_code >= 500
        assert await _state(pool, f"drop-{mode}") in ("pending", "unknown")
    assert await count(pool, "test_ledger") == (4 if mode is Mode.TRANSACTIONAL else 3)


@pytest.mark.parametrize("by", ["group", "sqla"])
async def test_statements_dropped_under_a_task_group_or_a_claim_session_harm_no_later_request(
    db_dsn: str, pool: Any, by: str
) -> None:
    """The same, when the refused statement comes back wrapped: in an ExceptionGroup (a task
    group's) or in SQLAlchemy's DBAPIError. The cache was emptied only for asyncpg's own error
    raised plainly: every later request the pool gave that connection was a 500, for good."""
    store = logged_store(db_dsn, QueryLog())
    async with store, client(_app(store, Mode.TRANSACTIONAL)) as c:
        first = await c.post(f"/write?by={by}&then=deallocate", json={}, headers=key("drop"))
        later = [await c.post(f"/write?by={by}", json={}, headers=key(f"l{i}")) for i in range(3)]
    assert first.status_code == 201, first.text
    assert [r.status_code for r in later] == [201, 201, 201], [r.text for r in later]
    assert await count(pool, "test_ledger") == 4


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("then", ["commit", "rollback"])
async def test_a_handler_ending_its_transaction_itself_is_reported_and_its_outcome_recorded(
    db_dsn: str, pool: Any, mode: Mode, then: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A COMMIT (or ROLLBACK) of the handler's own ends the transaction its outcome was to
    commit with: what it wrote until then is committed (or undone) whatever the outcome, and the
    key's claim is gone with the transaction. The outcome is still recorded (the writes may
    stand: a retry must not run them again), and the error is logged: it was silent."""
    caplog.set_level(logging.ERROR, logger="idem_middleware.store")
    store = logged_store(db_dsn, QueryLog())
    async with store, client(_app(store, mode)) as c:
        first = await c.post(f"/write?then={then}", json={}, headers=key(f"{then}-{mode}"))
        again = await c.post(f"/write?then={then}", json={}, headers=key(f"{then}-{mode}"))
        later = await c.post("/write", json={}, headers=key(f"after-{then}-{mode}"))
    assert first.status_code == 201, first.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert later.status_code == 201, later.text
    assert await _state(pool, f"{then}-{mode}") == "succeeded"
    # Run once: the write stands if the handler committed it, not if it rolled it back.
    assert await count(pool, "test_ledger") == (2 if then == "commit" else 1)
    ended = [r for r in caplog.records if "ended" in r.getMessage()]
    assert len(ended) == 1, [r.getMessage() for r in caplog.records]
