"""A lease-mode caller claimed as anonymous and named by the time its outcome is recorded
(CallerNamedLate), after its handler wrote through the fenced transaction: that transaction
is rolled back before the record is marked, so its writes never commit and the `unknown` mark
does not wait on the fence's row lock (it held the record `pending` until its lease lapsed,
and kept the fenced connection open)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from tests.apps import assert_problem, client, records


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pool=pool) as store:
        yield store


async def test_a_caller_named_late_after_fenced_writes_is_rolled_back_and_unknown(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    async def handler(request: Request) -> Response:
        await request.body()
        conn = await get_context(request).fenced_connection()
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('', 'acct', 5)"
        )
        request.state.tenant = "tenant-a"  # what an authentication inside would set
        return JSONResponse({"ok": 1}, status_code=201)

    def resolver(scope: Any) -> str | None:
        tenant: str | None = (scope.get("state") or {}).get("tenant")
        return tenant

    app = Starlette(
        routes=[Route("/charges", handler, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                tenant_resolver=resolver,
                default_policy=Policy(mode=Mode.LEASE, allow_anonymous=True, lease_seconds=30),
            )
        ],
    )
    async with client(app, token=None) as c:
        response = await asyncio.wait_for(
            c.post("/charges", json={}, headers={"idempotency-key": "k1"}), 10
        )
    assert_problem(response, 500, "server-misconfigured")
    assert [(row["tenant"], row["state"]) for row in await records(pool)] == [("", "unknown")]
    assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 0
    # (the fenced connection went back to the pool: nothing is left idle in a transaction)
    idle = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE state LIKE 'idle in transaction%' AND datname = current_database()"
    )
    assert idle == 0
