"""A unique violation is "another claim recorded this key first" (the attempt runs again) only
when the key has a record afterwards. Any other unique constraint that refuses a transaction
(a handler's deferred one, checked at COMMIT; one an operator added to the store's table) no
attempt can clear: one run, then a 500 naming it, the key free. Taken for a lost key, it ran
the handler 1 + max_retries times and answered "409, retry it" at every retry, for ever; the
claim's `ON CONFLICT DO NOTHING` (no conflict target) took an operator's constraint for a
record in flight ("still being processed") for ever."""

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

from idem_middleware import (
    IdempotencyMiddleware,
    Mode,
    Policy,
    PostgresStore,
    get_context,
)
from idem_middleware.errors import SettlementRefused
from idem_middleware.jobs import idempotent_job
from idem_middleware.outbox import consume_once
from tests.apps import BearerBackend, client, key

_RUNS: list[str] = []
_OPERATOR_UNIQUE = "operator_one_key_per_tenant"


async def _twice(request: Request) -> Response:
    """Writes one order id twice into a table of the app's own whose unique key is deferred."""
    _RUNS.append(request.url.path)
    table = request.path_params["table"]
    await get_context(request).connection.execute(f"INSERT INTO {table} VALUES (1), (1)")
    return JSONResponse({"ok": True}, status_code=201)


async def _once(request: Request) -> Response:
    """Writes order 1 into the app's table whose unique key is deferred: a second run breaks it."""
    _RUNS.append(request.url.path)
    await get_context(request).connection.execute("INSERT INTO orders_deferred VALUES (1)")
    return JSONResponse({"ok": True}, status_code=201)


async def _plain(request: Request) -> Response:
    _RUNS.append(request.url.path)
    ctx = get_context(request)
    if ctx.mode is Mode.LEASE:
        await ctx.fenced_connection()
    return JSONResponse({"ok": True}, status_code=201)


def _app(store: PostgresStore, mode: Mode = Mode.TRANSACTIONAL) -> Starlette:
    return Starlette(
        routes=[
            Route("/twice/{table}", _twice, methods=["POST"]),
            Route("/once", _once, methods=["POST"]),
            Route("/pay", _plain, methods=["POST"]),
            Route("/refund", _plain, methods=["POST"]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=Policy(mode=mode)),
        ],
    )


@pytest.fixture
async def app_tables(db_dsn: str) -> AsyncIterator[None]:
    """`orders_deferred`, and `idem_orders` (an app's own table named like the store's)."""
    conn = await asyncpg.connect(db_dsn)
    ddl = "(id int, CONSTRAINT {0}_u UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)"
    try:
        for table in ("orders_deferred", "idem_orders"):
            await conn.execute(
                f"DROP TABLE IF EXISTS {table}; CREATE TABLE {table} " + ddl.format(table)
            )
        _RUNS.clear()
        yield
    finally:
        await conn.execute("DROP TABLE IF EXISTS orders_deferred, idem_orders")
        await conn.close()


@pytest.fixture
async def operator_unique(db_dsn: str) -> AsyncIterator[None]:
    """One key per tenant across operations: a unique constraint an operator added."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            f"ALTER TABLE idem_requests ADD CONSTRAINT {_OPERATOR_UNIQUE} UNIQUE (tenant, idem_key)"
        )
        _RUNS.clear()
        yield
    finally:
        await conn.execute(
            f"ALTER TABLE idem_requests DROP CONSTRAINT IF EXISTS {_OPERATOR_UNIQUE}"
        )
        await conn.close()


async def _state(store: PostgresStore, name: str, operation: str) -> str | None:
    async with store.pool.acquire() as conn:
        state: str | None = await conn.fetchval(
            "SELECT state FROM idem_requests WHERE idem_key = $1 AND operation = $2",
            name,
            operation,
        )
    return state


@pytest.mark.usefixtures("app_tables")
@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_handlers_deferred_unique_constraint_is_refused_after_one_run(
    db_dsn: str, caplog: pytest.LogCaptureFixture, fast_path: bool
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    name = f"deferred-unique-{fast_path}"
    async with store, client(_app(store)) as c:
        r = await c.post("/twice/orders_deferred", json={}, headers=key(name))
        again = await c.post("/twice/orders_deferred", json={}, headers=key(name))
        state = await _state(store, name, "POST /twice/{table}")
    assert r.status_code == 500, r.text
    assert r.json()["type"].endswith("server-misconfigured"), r.text
    assert again.status_code == 500  # the same refusal, once more: no "409, retry it"
    assert len(_RUNS) == 2  # one run per request, none again for a "lost" key
    assert state is None  # the key is free
    assert "broke a deferred constraint" in caplog.text
    assert "orders_deferred_u" in caplog.text


@pytest.mark.usefixtures("app_tables")
@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_key_reused_after_its_retention_is_refused_after_one_run(
    db_dsn: str, fast_path: bool
) -> None:
    """Its expired record, taken over by the claim, is back after the rollback: not another
    claim's record (read so, the handler ran four times and the answer was "409, retry")."""
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    name = f"reused-after-retention-{fast_path}"
    async with store, client(_app(store)) as c:
        first = await c.post("/once", json={}, headers=key(name))
        async with store.pool.acquire() as conn:
            await conn.execute(
                "UPDATE idem_requests SET expires_at = now() - interval '1 second'"
                " WHERE idem_key = $1",
                name,
            )
        _RUNS.clear()
        again = await c.post("/once", json={}, headers=key(name))
        state = await _state(store, name, "POST /once")
    assert first.status_code == 201, first.text
    assert again.status_code == 500, again.text
    assert again.json()["type"].endswith("server-misconfigured"), again.text
    assert len(_RUNS) == 1
    assert state == "succeeded"  # the expired record, as it was


@pytest.mark.usefixtures("app_tables")
async def test_an_apps_table_named_like_the_stores_is_the_handlers(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    async with store, client(_app(store)) as c:
        r = await c.post("/twice/idem_orders", json={}, headers=key("app-table-idem-prefix"))
    assert r.status_code == 500, r.text
    assert "broke a deferred constraint" in caplog.text
    assert "the store's own table" not in caplog.text


@pytest.mark.usefixtures("operator_unique")
@pytest.mark.parametrize(
    ("mode", "fast_path"),
    [(Mode.TRANSACTIONAL, True), (Mode.TRANSACTIONAL, False), (Mode.LEASE, True)],
)
async def test_a_unique_constraint_added_to_the_store_table_is_refused_not_waited_on(
    db_dsn: str, caplog: pytest.LogCaptureFixture, mode: Mode, fast_path: bool
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    name = f"one-per-tenant-{mode.value}-{fast_path}"
    async with store, client(_app(store, mode)) as c:
        first = await c.post("/pay", json={}, headers=key(name))
        _RUNS.clear()
        second = await c.post("/refund", json={}, headers=key(name))
        paid, refunded = (
            await _state(store, name, "POST /pay"),
            await _state(store, name, "POST /refund"),
        )
    assert first.status_code == 201, first.text
    assert second.status_code == 500, second.text
    assert second.json()["type"].endswith("server-misconfigured"), second.text
    # Refused at the claim (the ordinary path, lease mode) or at the completion (a fast claim
    # writes the record there): at most one run, never a retry.
    assert len(_RUNS) <= 1
    assert (paid, refunded) == ("succeeded", None)
    assert _OPERATOR_UNIQUE in caplog.text


@pytest.mark.usefixtures("app_tables")
@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_jobs_deferred_unique_constraint_is_refused_after_one_run(
    db_dsn: str, fast_path: bool
) -> None:
    runs: list[str] = []
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2, fast_path=fast_path) as store:

        @idempotent_job(store, operation="make-order", key="order_id")
        async def make(ctx: object, *, order_id: str) -> dict[str, int]:
            runs.append(order_id)
            await ctx.connection.execute("INSERT INTO orders_deferred VALUES (1), (1)")  # type: ignore[attr-defined]
            return {"ok": 1}

        with pytest.raises(SettlementRefused, match="deferred constraint"):
            await make(order_id=f"order-{fast_path}")
    assert len(runs) == 1


async def test_an_inbox_unique_constraint_is_no_redelivery(db_dsn: str) -> None:
    """The inbox's note of an event is refused by a unique constraint other than its key (an
    operator's, one event per all consumers): the error, not "seen before" (which would have
    had the consumer skip an event it never applied)."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "DELETE FROM idem_inbox WHERE event_id = 'evt-shared';"
            "ALTER TABLE idem_inbox ADD CONSTRAINT operator_one_event UNIQUE (event_id)"
        )
        async with conn.transaction():
            assert await consume_once(conn, "billing", "evt-shared") is True
        async with conn.transaction():
            assert await consume_once(conn, "billing", "evt-shared") is False  # a redelivery
        with pytest.raises(asyncpg.UniqueViolationError):
            async with conn.transaction():
                await consume_once(conn, "shipping", "evt-shared")
    finally:
        await conn.execute(
            "ALTER TABLE idem_inbox DROP CONSTRAINT IF EXISTS operator_one_event;"
            "DELETE FROM idem_inbox WHERE event_id = 'evt-shared'"
        )
        await conn.close()
