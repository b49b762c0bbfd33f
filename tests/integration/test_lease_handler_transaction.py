"""Lease mode: a handler that leaves its fenced transaction unable to record the outcome (it
caught the error of one of its statements there and answered anyway, or changed the session's
role). Its fenced writes roll back, but what it did outside the database may have happened: the
record is `unknown` (never run again until it is resolved), and the client gets `500
server-misconfigured` as problem+json, not the server's text/plain 500. A status that releases
the key (409) still reaches the client as the handler wrote it. (Transactional mode's
counterpart: test_handler_transaction.py.)"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import Request

from idem_middleware import Mode, Policy, PostgresStore, get_context
from idem_middleware.fastapi import install
from tests.apps import assert_problem, count

_WRITE = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', 1)"
_FAILING = {
    "division": "SELECT 1 / 0",
    "not-null": "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', NULL)",
    "role": "SET LOCAL ROLE test_no_store",
}


@pytest.fixture
async def store(pool: asyncpg.Pool[Any], fast_path: bool) -> AsyncIterator[PostgresStore]:
    await pool.execute(
        "DO $$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'test_no_store') THEN "
        "CREATE ROLE test_no_store; END IF; END$$;"
    )
    async with PostgresStore(pool=pool, fast_path=fast_path) as store:
        yield store


async def _twice(store: PostgresStore, failing: str, status: int) -> tuple[list[Any], int]:
    app = FastAPI()
    calls = 0

    @app.post("/charge")
    async def charge(request: Request) -> Any:
        nonlocal calls
        calls += 1
        conn = await get_context(request).fenced_connection()
        await conn.execute(_WRITE)
        try:
            await conn.execute(_FAILING[failing])
        except asyncpg.PostgresError as exc:
            return JSONResponse({"error": type(exc).__name__}, status_code=status)
        return JSONResponse({"charged": True}, status_code=status)

    install(
        app, store=store, tenant_resolver=lambda scope: "t", default_policy=Policy(mode=Mode.LEASE)
    )
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        answers = [
            await http.post("/charge", json={}, headers={"Idempotency-Key": "k"}) for _ in "12"
        ]
    return answers, calls


async def _states(pool: asyncpg.Pool[Any]) -> list[str]:
    return [r["state"] for r in await pool.fetch("SELECT state FROM idem_requests")]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"], indirect=True)
@pytest.mark.parametrize("status", [201, 402])
@pytest.mark.parametrize("failing", list(_FAILING))
async def test_an_answer_the_fenced_transaction_cannot_record_is_a_problem_and_unknown(
    store: PostgresStore,
    pool: asyncpg.Pool[Any],
    failing: str,
    status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by probing: the fenced settlement met the aborted transaction (or a role without
    the store's privileges) and asyncpg's error went out of the middleware as it was (a
    text/plain 500); the record was marked `unknown` as now."""
    caplog.set_level(logging.ERROR, logger="idem_middleware")
    (first, again), calls = await _twice(store, failing, status)
    problem = assert_problem(first, 500, "server-misconfigured")
    assert "what it did elsewhere is not known" in problem["detail"]
    assert_problem(again, 409, "outcome-unknown")  # never run again until it is resolved
    assert calls == 1
    assert await _states(pool) == ["unknown"]
    assert await count(pool, "test_ledger") == 0  # the fenced write before the failure rolled back
    if failing != "role":
        assert "savepoint" in caplog.text  # the log says what to do instead


async def test_a_releasing_answer_after_a_caught_failure_reaches_the_client(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    (first, again), calls = await _twice(store, "division", 409)
    assert (first.status_code, again.status_code) == (409, 409)
    assert first.json() == again.json() == {"error": "DivisionByZeroError"}
    assert calls == 2  # released: the retry runs it again
    assert await count(pool, "test_ledger") == 0
