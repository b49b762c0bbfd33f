"""A ClaimSession used by a stream after its first byte: the claim's connection was given back
to the pool (docs/concurrency.md, "Streams hold no connection"), so the session's writes must
fail, never run on that connection in the transaction of the request that holds it next."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from sqlalchemy import exc, text
from starlette.middleware.authentication import AuthenticationMiddleware

from idem_middleware import Mode, idempotent
from idem_middleware.fastapi import Idempotency, install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore
from tests.apps import BearerBackend

INSERT = text(
    "INSERT INTO test_sqla_orders (id, tenant, amount) VALUES (:id, :tenant, 1) "
    "RETURNING pg_backend_pid(), txid_current()"
)


@pytest.fixture
async def one_connection(
    pool: asyncpg.Pool[Any], db_target: tuple[str, dict[str, Any]]
) -> AsyncIterator[PostgresStore]:
    """A store over a pool of one connection: request B can only get request A's."""
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS test_sqla_orders (id text PRIMARY KEY, tenant text NOT NULL, "
        "amount bigint NOT NULL, meta json)"
    )
    await pool.execute("TRUNCATE test_sqla_orders")
    dsn, options = db_target
    small = await asyncpg.create_pool(dsn, min_size=1, max_size=1, **options)
    try:
        async with PostgresStore(pool=small) as store:
            yield store
    finally:
        await small.close()


class Run:
    def __init__(self) -> None:
        self.streaming = asyncio.Event()  # A's first byte went out: its connection is back
        self.b_inside = asyncio.Event()  # B holds that connection in its claim's transaction
        self.a_wrote = asyncio.Event()
        self.a_late: object = None  # what A's write after the first byte did
        self.b_wrote: tuple[int, int] | None = None


def app(store: PostgresStore, run: Run, mode: Mode) -> FastAPI:
    api = FastAPI()

    @api.post("/events")
    @idempotent(mode=mode)
    async def events(session: ClaimSession, idem: Idempotency) -> StreamingResponse:
        await session.execute(INSERT, {"id": "a-before", "tenant": idem.tenant})

        async def stream() -> AsyncIterator[bytes]:
            yield b"data: started\n\n"
            run.streaming.set()
            await asyncio.wait_for(run.b_inside.wait(), 10)
            try:
                row = await session.execute(INSERT, {"id": "a-late", "tenant": idem.tenant})
                run.a_late = tuple(row.one())
            except Exception as error:  # what the test looks at
                run.a_late = error
            run.a_wrote.set()
            yield b"data: done\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @api.post("/orders", status_code=201)
    @idempotent(mode=mode)
    async def orders(session: ClaimSession, idem: Idempotency) -> dict[str, bool]:
        try:
            row = await session.execute(INSERT, {"id": "b", "tenant": idem.tenant})
            pid, xid = row.one()
            run.b_wrote = (pid, xid)
        finally:
            run.b_inside.set()  # (also when B fails: A must not wait forever)
        await asyncio.wait_for(run.a_wrote.wait(), 10)
        if idem.key == "b-fails":
            raise RuntimeError("B fails: its transaction rolls back")
        return {"ok": True}

    install(api, store=store)
    api.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return api


def client(api: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api, raise_app_exceptions=False),
        base_url="http://test",
    )


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("b_key", ["b-ok", "b-fails"])
async def test_session_write_after_first_byte_fails_and_spares_the_next_claim(
    one_connection: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode, b_key: str
) -> None:
    run = Run()
    async with client(app(one_connection, run, mode)) as http:
        a = asyncio.create_task(
            http.post(
                "/events",
                headers={"Authorization": "Bearer demo-a", "Idempotency-Key": "a-key"},
            )
        )
        await asyncio.wait_for(run.streaming.wait(), 10)
        b = await http.post(
            "/orders", headers={"Authorization": "Bearer demo-b", "Idempotency-Key": b_key}
        )
        a_response = await a

    # A's late write failed loudly, and ran nowhere.
    assert isinstance(run.a_late, exc.InterfaceError), run.a_late
    assert "released back to the pool" in str(run.a_late)
    # A's stream and its claim are unharmed (the session's end has nothing left to do).
    assert a_response.status_code == 200
    assert a_response.content == b"data: started\n\ndata: done\n\n"
    # B had the connection and its session, and its transaction held only its own write.
    assert run.b_wrote is not None
    if b_key == "b-ok":
        assert b.status_code == 201, b.text
    else:
        assert b.status_code == 500
    rows = [r["id"] for r in await pool.fetch("SELECT id FROM test_sqla_orders ORDER BY id")]
    assert rows == (["a-before", "b"] if b_key == "b-ok" else ["a-before"])
    states = {
        r["idem_key"]: r["state"]
        for r in await pool.fetch("SELECT idem_key, state FROM idem_requests")
    }
    assert states["a-key"] == "succeeded"
    failed = "unknown" if mode is Mode.LEASE else None  # (transactional: the key is free)
    assert states.get(b_key) == ("succeeded" if b_key == "b-ok" else failed)
    assert one_connection.pool.get_idle_size() == 1  # nothing kept the connection
