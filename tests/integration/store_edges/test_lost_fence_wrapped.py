"""A lease-mode handler whose fenced connection is lost, and which wraps the driver's error in
one of its own while handling it (`except ...: raise MyError(...)`, no `from`: an ORM's or an
app's error type, chained implicitly): the lost connection is still the store's trouble, 503
store-unavailable, not the handler's 500 (convert.reports_lost follows `__context__` too)."""

from __future__ import annotations

import asyncpg
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, get_context
from tests.apps import LEDGER_INSERT, client, count, one_route_app
from tests.apps.checks import assert_problem


class LedgerUnavailable(Exception):
    """The app's own error for a failed write."""


async def test_a_lost_fenced_connection_wrapped_during_handling_is_a_503(
    pg_store: PostgresStore, pool: asyncpg.Pool
) -> None:
    async def handler(request: Request) -> Response:
        connection = await get_context(request).fenced_connection()
        pid = await connection.fetchval("SELECT pg_backend_pid()")
        await pool.execute("SELECT pg_terminate_backend($1)", pid)
        try:
            await connection.execute(LEDGER_INSERT, "tenant-a", "acc", 1)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
            raise LedgerUnavailable("the ledger write failed")  # noqa: B904 - implicit on purpose
        return JSONResponse({}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=5.0)
    app = one_route_app("/pay", handler, store=pg_store, policies={"POST /pay": policy})
    async with client(app) as c:
        lost = await c.post("/pay", json={}, headers={"Idempotency-Key": "lost-wrapped"})
    assert_problem(lost, 503, "store-unavailable")
    assert await count(pool, "test_ledger") == 0
