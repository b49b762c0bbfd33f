"""Requests with ever new keys and tenants against the real store leave nothing behind in the
process per key or per tenant: no watch, no wait registration, no held key or slot, and no
prepared statement per value (every statement's text is the same whatever the request)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Policy
from idem_middleware.policy import Mode
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_bounds_storm_postgres import call, handler, in_process, tenant_of

pytestmark = pytest.mark.asyncio


def statements(pool: Any) -> list[int]:
    """How many statements each of the pool's open connections has prepared and cached."""
    counts = []
    for holder in pool._holders:
        conn = holder._con
        if conn is not None and not conn.is_closed():
            counts.append(len(conn._stmt_cache))
    return counts


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_new_keys_and_tenants_grow_nothing_in_the_process(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    app = Starlette(routes=[Route("/pay", handler, methods=["POST"])])
    mw = IdempotencyMiddleware(
        app,
        store=pg_store,
        default_policy=Policy(mode=mode),
        max_tenant_connections=4,
        tenant_resolver=tenant_of,
    )
    for batch in range(40):
        calls = (
            call(mw, f"key-{batch}-{n}", f"tenant-{batch}-{n % 7}", "ok", None) for n in range(25)
        )
        await asyncio.gather(*calls)
        if batch == 1:
            after_warm_up = max(statements(pool))
    assert not any(in_process(mw, pg_store).values()), in_process(mw, pg_store)
    assert len(pg_store._deadlines) <= 1
    assert max(statements(pool)) <= after_warm_up + 2, statements(pool)
    assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 1_000
