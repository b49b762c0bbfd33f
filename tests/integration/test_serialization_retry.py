"""Serialization failures and deadlocks (40001, 40P01) re-run the whole transaction, bounded."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Policy, PostgresStore, get_context
from tests.apps import client

# A real server-side error with the SQLSTATE PostgreSQL uses for these conflicts.
RAISE = "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '{code}'; END $$"


def app_failing(store: PostgresStore, code: str, failures: int, retries: int) -> Starlette:
    calls = {"n": 0}

    async def handler(request: Request) -> JSONResponse:
        calls["n"] += 1
        conn = get_context(request).connection
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', 1)"
        )
        if calls["n"] <= failures:
            await conn.execute(RAISE.format(code=code))
        return JSONResponse({"call": calls["n"]}, status_code=201)

    app = Starlette(
        routes=[Route("/w", handler, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                default_policy=Policy(allow_anonymous=True, max_serialization_retries=retries),
            )
        ],
    )
    app.state.calls = calls
    return app


@pytest.mark.parametrize("code", ["40001", "40P01"])
async def test_a_conflict_reruns_the_transaction_once_more(
    pg_store: PostgresStore, pool: Any, code: str
) -> None:
    app = app_failing(pg_store, code, failures=2, retries=3)
    async with client(app, token=None) as c:
        r = await c.post("/w", json={}, headers={"idempotency-key": "k"})
        again = await c.post("/w", json={}, headers={"idempotency-key": "k"})
    assert r.status_code == 201
    assert r.json() == {"call": 3}  # two rolled-back attempts, then the one that committed
    assert again.headers["idempotent-replayed"] == "true"
    assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 1


async def test_retries_are_bounded(pg_store: PostgresStore, pool: Any) -> None:
    app = app_failing(pg_store, "40001", failures=10, retries=2)
    async with client(app, token=None) as c:
        r = await c.post("/w", json={}, headers={"idempotency-key": "k"})
    assert r.status_code == 500  # the handler's error, after 1 + 2 attempts
    assert app.state.calls["n"] == 3
    assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 0
    assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 0
