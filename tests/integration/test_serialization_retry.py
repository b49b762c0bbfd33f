"""Serialization failures and deadlocks (40001, 40P01) re-run the whole transaction, bounded."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Policy, PostgresStore, get_context
from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession
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


@pytest.mark.parametrize("code", ["40001", "40P01"])
async def test_a_conflict_met_through_a_claim_session_reruns_the_transaction(
    pg_store: PostgresStore, pool: Any, code: str
) -> None:
    """SQLAlchemy wraps the server's error (twice: its DBAPI adapter's error, then
    `sqlalchemy.exc.DBAPIError`), raised from asyncpg's: it is the same conflict, and the
    attempt runs again (it was answered 500)."""
    calls = {"n": 0}
    app = FastAPI()

    @app.post("/w", status_code=201)
    async def handler(session: ClaimSession) -> dict[str, int]:
        calls["n"] += 1
        insert = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', 1)"
        await session.execute(text(insert))
        if calls["n"] <= 2:
            await session.execute(text(RAISE.format(code=code)))
        return {"call": calls["n"]}

    install(app, store=pg_store, tenant_resolver=lambda scope: "t")
    async with client(app, token=None) as c:  # type: ignore[arg-type]
        r = await c.post("/w", json={}, headers={"idempotency-key": "k"})
        again = await c.post("/w", json={}, headers={"idempotency-key": "k"})
    assert r.status_code == 201, r.text
    assert r.json() == {"call": 3}
    assert again.headers["idempotent-replayed"] == "true"
    assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 1


async def test_a_statement_plan_a_migration_invalidated_reruns_the_transaction(
    db_dsn: str, pool: Any
) -> None:
    """A migration while the app serves (here `ALTER TABLE ... ADD COLUMN` under a `SELECT *`):
    the next use of a statement the connection had prepared fails once with asyncpg's
    InvalidCachedStatementError, which asyncpg re-prepares by itself only outside a transaction.
    In the claim's transaction it was a 500 per pooled connection; the attempt's writes rolled
    back, so it now runs again, as after a serialization failure, and the request is served."""
    await pool.execute("DROP TABLE IF EXISTS migrating; CREATE TABLE migrating (id int, v int)")
    calls: list[str] = []

    async def handler(request: Request) -> JSONResponse:
        conn = get_context(request).connection
        calls.append(request.headers["idempotency-key"])
        rows = await conn.fetch("SELECT * FROM migrating")
        await conn.execute("INSERT INTO migrating (id, v) VALUES ($1, 1)", len(calls))
        return JSONResponse({"rows": len(rows)}, status_code=201)

    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False)
    app = Starlette(
        routes=[Route("/m", handler, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware, store=store, default_policy=Policy(allow_anonymous=True)
            )
        ],
    )
    try:
        async with store, client(app, token=None) as c:
            first = await c.post("/m", json={}, headers={"idempotency-key": "before"})
            await pool.execute("ALTER TABLE migrating ADD COLUMN w int")
            after = await c.post("/m", json={}, headers={"idempotency-key": "after"})
        assert first.status_code == 201
        assert after.status_code == 201, after.text
        assert calls == ["before", "after", "after"]  # the invalidated attempt, then its rerun
        assert await pool.fetchval("SELECT count(*) FROM migrating") == 2
    finally:
        await pool.execute("DROP TABLE IF EXISTS migrating")
