"""A FastAPI handler that leaves the claim's transaction unable to record its outcome: it caught
the error of one of its statements (a duplicate, a NOT NULL, a division by zero) and
answered anyway, or it changed the session so that the store's table cannot be reached (`SET
ROLE`, `search_path`). Nothing of the transaction commits, so no answer claiming something was
done may be stored: the client gets `500 server-misconfigured` (problem+json, not a traceback),
nothing is recorded, and the retry runs the handler again. A status that releases the key (409,
422) still reaches the client as the handler wrote it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from idem_middleware.fastapi import IdempotencyConnection, install
from idem_middleware.store.postgres import PostgresStore
from tests.apps import assert_problem, count

_FAILING = {
    "duplicate": "INSERT INTO test_accounts (tenant, account_id) VALUES ('t', 'taken')",
    "not-null": "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', NULL)",
    "division": "SELECT 1 / 0",
}
_SETTINGS = {
    "role": "SET ROLE test_no_store",
    "local-role": "SET LOCAL ROLE test_no_store",
    "search-path": "SET LOCAL search_path TO test_other",
}


@pytest.fixture
async def store(pool: asyncpg.Pool[Any], fast_path: bool) -> AsyncIterator[PostgresStore]:
    await pool.execute(
        "INSERT INTO test_accounts (tenant, account_id) VALUES ('t', 'taken');"
        "CREATE SCHEMA IF NOT EXISTS test_other;"
        "DO $$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'test_no_store') THEN "
        "CREATE ROLE test_no_store; END IF; END$$;"
        "GRANT USAGE ON SCHEMA test_other TO test_no_store"
    )
    async with PostgresStore(pool=pool, fast_path=fast_path) as store:
        yield store


class Calls:
    n = 0


def app_of(store: PostgresStore, calls: Calls) -> FastAPI:
    app = FastAPI()

    @app.post("/caught/{failing}/{status}")
    async def caught(failing: str, status: int, conn: IdempotencyConnection) -> Any:
        calls.n += 1
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', 1)"
        )
        try:
            await conn.execute(_FAILING[failing])
        except asyncpg.PostgresError as exc:
            return JSONResponse({"error": type(exc).__name__}, status_code=status)
        return JSONResponse({"ok": True}, status_code=201)

    @app.post("/setting/{name}", status_code=201)
    async def setting(name: str, conn: IdempotencyConnection) -> Any:
        calls.n += 1
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', 1)"
        )
        await conn.execute(_SETTINGS[name])
        return {"ok": True}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    return app


async def _twice(store: PostgresStore, path: str) -> tuple[httpx.Response, httpx.Response, int]:
    calls = Calls()
    transport = httpx.ASGITransport(app=app_of(store, calls), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first = await http.post(path, json={}, headers={"Idempotency-Key": path})
        again = await http.post(path, json={}, headers={"Idempotency-Key": path})
    return first, again, calls.n


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"], indirect=True)
@pytest.mark.parametrize("status", [201, 402])
@pytest.mark.parametrize("failing", list(_FAILING))
async def test_an_answer_after_a_caught_failure_is_refused_and_nothing_recorded(
    store: PostgresStore,
    pool: asyncpg.Pool[Any],
    failing: str,
    status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by probing: the completion met the aborted transaction and asyncpg's
    InFailedSQLTransactionError went out of the middleware as it was (a text/plain 500 and a
    traceback, `idem_middleware` naming neither the cause nor the fix)."""
    caplog.set_level(logging.ERROR, logger="idem_middleware")
    first, again, calls = await _twice(store, f"/caught/{failing}/{status}")
    for answer in (first, again):
        problem = assert_problem(answer, 500, "server-misconfigured")
        assert "nothing of it was committed" in problem["detail"]
    assert calls == 2  # nothing was recorded: the retry ran the handler again
    assert await count(pool, "idem_requests") == 0
    assert await count(pool, "test_ledger") == 0  # the write before the failure rolled back
    assert "savepoint" in caplog.text  # the log says what to do instead


@pytest.mark.parametrize("failing", list(_FAILING))
async def test_a_releasing_answer_after_a_caught_failure_reaches_the_client(
    store: PostgresStore, pool: asyncpg.Pool[Any], failing: str
) -> None:
    first, again, calls = await _twice(store, f"/caught/{failing}/409")
    assert (first.status_code, again.status_code) == (409, 409)
    assert first.json() == {"error": again.json()["error"]}
    assert calls == 2
    assert await count(pool, "idem_requests") == 0
    assert await count(pool, "test_ledger") == 0


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"], indirect=True)
@pytest.mark.parametrize("name", list(_SETTINGS))
async def test_a_session_that_cannot_reach_the_store_gets_a_problem_not_a_traceback(
    store: PostgresStore, pool: asyncpg.Pool[Any], name: str
) -> None:
    first, again, calls = await _twice(store, f"/setting/{name}")
    assert_problem(first, 500, "server-misconfigured")
    assert_problem(again, 500, "server-misconfigured")
    assert calls == 2
    assert await count(pool, "idem_requests") == 0
    assert await count(pool, "test_ledger") == 0
