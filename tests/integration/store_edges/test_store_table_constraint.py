"""A constraint an operator added to the store's own table that refuses the record of an outcome
(a CHECK on `idem_requests`, say): the settlement is refused in words that name the store's
table, not as the handler's deferred constraint; nothing is committed in transactional mode (the
key is free), and in lease mode the record is left unknown, as for any refused settlement."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from tests.apps import BearerBackend, client, key

_CONSTRAINT = "operator_no_299"


async def odd(request: Request) -> Response:
    ctx = get_context(request)
    if ctx.mode is Mode.LEASE:
        await ctx.fenced_connection()
    return JSONResponse({"ok": True}, status_code=299)


def _app(store: PostgresStore, mode: Mode) -> Starlette:
    return Starlette(
        routes=[Route("/odd", odd, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=Policy(mode=mode)),
        ],
    )


@pytest.fixture
async def operator_check(db_dsn: str) -> AsyncIterator[None]:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            f"ALTER TABLE idem_requests ADD CONSTRAINT {_CONSTRAINT} "
            "CHECK (response_status IS DISTINCT FROM 299) NOT VALID"
        )
        yield
    finally:
        await conn.execute(f"ALTER TABLE idem_requests DROP CONSTRAINT IF EXISTS {_CONSTRAINT}")
        await conn.close()


@pytest.mark.usefixtures("operator_check")
@pytest.mark.parametrize(
    ("mode", "fast_path"),
    [(Mode.TRANSACTIONAL, True), (Mode.TRANSACTIONAL, False), (Mode.LEASE, True)],
)
async def test_a_constraint_on_the_store_table_is_named_as_the_store_tables(
    db_dsn: str, caplog: pytest.LogCaptureFixture, mode: Mode, fast_path: bool
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False, fast_path=fast_path)
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    name = f"odd-{mode.value}-{fast_path}"
    async with store, client(_app(store, mode)) as c:
        r = await c.post("/odd", json={}, headers=key(name))
        async with store.pool.acquire() as conn:
            state = await conn.fetchval("SELECT state FROM idem_requests WHERE idem_key = $1", name)
    assert r.status_code >= 500, r.text
    assert state == (None if mode is Mode.TRANSACTIONAL else "unknown")
    # (The records' words and their errors' own: the traceback's source lines are not read.)
    messages = " ".join(
        f"{rec.getMessage()} {rec.exc_info[1] if rec.exc_info else ''}" for rec in caplog.records
    )
    assert "deferred constraint" not in messages
    assert "idem_requests" in messages
    assert _CONSTRAINT in messages
