"""`outbox.add` during an idempotent operation runs in the operation's transaction, or not at all.

Found by probing: a handler that passed the pool (or a connection of its own, in autocommit) to
`add` had its event committed at once, and published, whatever became of the handler's writes:
rolled back with its claim, or run again after a serialization failure (two events). During an
idempotent operation (a guarded request's handler, a job) that is a TypeError, nothing written;
outside one, an event on a pool is a standalone event, as before.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, get_context
from idem_middleware.jobs import idempotent_job
from idem_middleware.outbox import add
from tests.apps import client, key, one_route_app


async def _events(pool: Any) -> list[str]:
    return [r["event_id"] for r in await pool.fetch("SELECT event_id FROM idem_outbox")]


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_an_event_added_on_the_pool_during_a_request_is_refused(
    pool: asyncpg.Pool[Any], mode: Mode
) -> None:
    refused: list[str] = []

    async def pay(request: Request) -> Response:
        ctx = get_context(request)
        try:
            await add(pool, "paid", {"n": 1}, event_id=f"pool-{mode}")
        except TypeError as exc:
            refused.append(str(exc))
        conn = ctx.connection if mode is Mode.TRANSACTIONAL else await ctx.fenced_connection()
        await add(conn, "paid", {"n": 1}, event_id=f"claim-{mode}")
        return JSONResponse({}, status_code=201)

    store = PostgresStore(pool=pool, listen=False)
    app = one_route_app("/pay", pay, store=store, default_policy=Policy(mode=mode))
    async with client(app) as c:
        r = await c.post("/pay", json={}, headers=key(f"k-{mode}"))
    assert r.status_code == 201, r.text
    assert len(refused) == 1
    assert "add during an idempotent operation runs on the connection" in refused[0]
    assert await _events(pool) == [f"claim-{mode}"]  # the claim's own, committed with it


async def test_an_event_added_on_the_pool_in_a_job_is_refused_and_outside_one_is_standalone(
    pool: asyncpg.Pool[Any],
) -> None:
    store = PostgresStore(pool=pool, listen=False)

    @idempotent_job(store, operation="notify", key="k")
    async def notify(ctx: Any, *, k: str) -> int:
        await add(pool, "notified", {"k": k}, event_id=f"job-{k}")
        return 1

    with pytest.raises(TypeError, match="add during an idempotent operation"):
        await notify(k="a")
    await add(pool, "standalone", {"n": 1}, event_id="standalone")  # (no operation: as before)
    assert await _events(pool) == ["standalone"]


async def test_a_payload_the_client_encoding_cannot_carry_is_not_quoted_in_the_error(
    db_dsn: str,
) -> None:
    """asyncpg's error for a payload a LATIN1 connection cannot send quoted the payload (personal
    data, in the app's log with the traceback). It is asyncpg's error still, without the value."""
    conn = await asyncpg.connect(db_dsn, server_settings={"client_encoding": "LATIN1"})
    try:
        async with conn.transaction():
            with pytest.raises(asyncpg.exceptions.DataError) as raised:
                await add(conn, "signup", {"name": "東京 customer"}, event_id="latin1-1")
    finally:
        await conn.close()
    assert "東京" not in str(raised.value)
    assert "client_encoding" in str(raised.value)
