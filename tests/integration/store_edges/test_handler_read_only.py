"""A handler that made its own transaction read-only (`SET TRANSACTION READ ONLY`) cannot have
its outcome recorded: refused, 500 server-misconfigured, after one run. It was taken for a
server that takes no writes (a standby): 503 "retry", the handler run again at every retry, for
ever (in lease mode, then 409 outcome-unknown). Sessions that do default to read-only still get
the 503: that is the server's, and passes."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, get_context
from tests.apps import client, key, one_route_app

_runs: list[str] = []


async def read_only(request: Request) -> Response:
    ctx = get_context(request)
    _runs.append(ctx.key)
    conn = ctx.connection if ctx.mode is Mode.TRANSACTIONAL else await ctx.fenced_connection()
    await conn.execute("SET TRANSACTION READ ONLY")
    await conn.fetchval("SELECT 1")
    return JSONResponse({"read": True}, status_code=200)


def _app(store: PostgresStore, mode: Mode) -> Any:
    return one_route_app("/read", read_only, store=store, default_policy=Policy(mode=mode))


@pytest.mark.parametrize(
    ("mode", "fast_path"),
    [(mode, fast_path) for mode in (Mode.TRANSACTIONAL, Mode.LEASE) for fast_path in (True, False)],
)
async def test_a_handlers_read_only_transaction_is_refused_after_one_run(
    db_dsn: str, mode: Mode, fast_path: bool
) -> None:
    _runs.clear()
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    name = f"read-only-{mode.value}-{fast_path}"
    async with store, client(_app(store, mode)) as c:
        r = await c.post("/read", json={}, headers=key(name))
        async with store.pool.acquire() as conn:
            state = await conn.fetchval("SELECT state FROM idem_requests WHERE idem_key = $1", name)
    assert r.status_code == 500, r.text
    assert r.json()["type"].endswith("server-misconfigured"), r.text
    assert "retry-after" not in r.headers
    assert _runs == [name]
    assert state == (None if mode is Mode.TRANSACTIONAL else "unknown")


async def test_sessions_that_default_to_read_only_are_still_unavailable(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server's doing (a role or database set read-only after the store opened): 503."""
    read_only_sessions = False

    async def init(conn: asyncpg.Connection) -> None:
        if read_only_sessions:
            await conn.execute("SET default_transaction_read_only = on")

    async def nothing(request: Request) -> Response:
        return JSONResponse({}, status_code=200)

    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=1, init=init)
    try:
        async with PostgresStore(pool=pool, listen=False) as store:
            app = one_route_app("/nothing", nothing, store=store)
            async with client(app) as c:
                # (The first draws generations ahead, so the next claim writes nothing and its
                # record's INSERT is the first write refused.)
                first = await c.post("/nothing", json={}, headers=key("writable-sessions"))
                read_only_sessions = True
                await pool.expire_connections()
                r = await c.post("/nothing", json={}, headers=key("read-only-sessions"))
        assert first.status_code == 200, first.text
        assert r.status_code == 503, r.text
        assert "retry-after" in r.headers
        assert "takes no writes" in caplog.text
    finally:
        await pool.close()
