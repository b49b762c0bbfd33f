"""FastAPI's streaming `yield` path operations behind the middleware, on PostgreSQL.

An `EventSourceResponse` generator's body runs in a task of FastAPI's own, beside the response,
which starts (and so settles the claim) before the generator's first event: the claim's
connection or session taken as its parameter raced the settlement (transactional: a 500 on every
request, "another operation is in progress"). Refused at startup now; a dependency, which runs
before the response, writes in the claim as in any handler."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import Annotated, Any

import asyncpg
import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.types import Message

from idem_middleware import ConfigurationError, Mode, Policy, StaleGeneration
from idem_middleware.fastapi import Idempotency, IdempotencyConnection, install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore
from tests.apps import BOUND

pytestmark = pytest.mark.asyncio

INSERT = "INSERT INTO test_accounts (tenant, account_id) VALUES ('t', $1)"


async def startup(app: Any) -> list[Message]:
    """The ASGI lifespan startup (and shutdown), as a server runs it; what the app sent."""
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    with contextlib.suppress(ConfigurationError):
        await app(scope, receive, send)
    return sent


async def record_order(conn: IdempotencyConnection) -> str:
    """A dependency of the stream's: it runs before the response starts, inside the claim."""
    await conn.execute(INSERT, "from-dependency")
    return "from-dependency"


async def test_an_event_stream_generator_taking_the_claims_connection_fails_the_startup(
    pg_store: PostgresStore,
) -> None:
    app = FastAPI()

    @app.post("/raw", response_class=EventSourceResponse)
    async def raw(conn: IdempotencyConnection) -> AsyncIterable[ServerSentEvent]:
        await conn.execute(INSERT, "raw")
        yield ServerSentEvent(data="done")

    @app.post("/orm", response_class=EventSourceResponse)
    async def orm(session: ClaimSession) -> AsyncIterable[ServerSentEvent]:
        yield ServerSentEvent(data="done")

    install(app, store=pg_store, tenant_resolver=lambda scope: "t")
    sent = await startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
    message = sent[0]["message"]
    assert (
        "POST /raw declares IdempotencyConnection in a generator of server-sent events" in message
    )
    assert "POST /orm declares ClaimSession in a generator of server-sent events" in message


async def test_an_event_stream_writes_in_its_dependency_with_the_outcome(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """What the startup error advises: the dependency runs before the response starts, in the
    claim; the generator reads the key through `Idempotency`."""
    app = FastAPI()
    runs: list[str] = []

    @app.post("/events", response_class=EventSourceResponse)
    async def events(
        idem: Idempotency, order: Annotated[str, Depends(record_order)]
    ) -> AsyncIterable[ServerSentEvent]:
        runs.append(idem.key)
        yield ServerSentEvent(data=order)

    install(app, store=pg_store, tenant_resolver=lambda scope: "t")
    assert [m["type"] for m in await startup(app)] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = await client.post("/events", headers={"Idempotency-Key": "k"})
        again = await client.post("/events", headers={"Idempotency-Key": "k"})
    assert (first.status_code, first.text) == (200, 'data: "from-dependency"\n\n')
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotency-body-omitted"] == "streaming"
    assert runs == ["k"]
    rows = await pool.fetch("SELECT account_id FROM test_accounts")
    assert [r["account_id"] for r in rows] == ["from-dependency"]
    states = await pool.fetch("SELECT state FROM idem_requests")
    assert [r["state"] for r in states] == ["succeeded"]


async def test_a_fenced_connection_asked_for_while_the_stream_settles_is_refused(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """Lease mode: the generator asks for its fenced connection while the response's start
    settles the claim. The fence opened during the settlement held the record's row, the
    settlement waited for it, and the client got `409` "lost its claim" for a record that
    settled as a success (or the request hung). Refused now, as after the settlement: the
    stream goes out and the record holds its outcome, without the refused write."""
    app = FastAPI()
    seen: list[str] = []

    @app.post("/events", response_class=EventSourceResponse)
    async def events(idem: Idempotency) -> AsyncIterable[ServerSentEvent]:
        try:
            conn = await idem.fenced_connection()
            await conn.execute(INSERT, "from-generator")
        except StaleGeneration as exc:
            seen.append(type(exc).__name__)
        yield ServerSentEvent(data="done")

    install(
        app,
        store=pg_store,
        tenant_resolver=lambda scope: "t",
        default_policy=Policy(mode=Mode.LEASE),
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = await asyncio.wait_for(
            client.post("/events", headers={"Idempotency-Key": "k"}), BOUND
        )
        again = await client.post("/events", headers={"Idempotency-Key": "k"})
    assert (first.status_code, first.text) == (200, 'data: "done"\n\n')
    assert seen == ["StaleGeneration"]
    assert again.headers["idempotency-body-omitted"] == "streaming"
    assert await pool.fetchval("SELECT count(*) FROM test_accounts") == 0
    states = await pool.fetch("SELECT state FROM idem_requests")
    assert [r["state"] for r in states] == ["succeeded"]


async def unit_of_work(request: Request, conn: IdempotencyConnection) -> AsyncIterator[None]:
    """The app's own dependency with `yield`: writes after it, and fails the first time."""
    yield
    teardowns: list[str] = request.app.state.teardowns
    name = f"teardown-{len(teardowns)}"
    teardowns.append(name)
    await conn.execute(INSERT, name)
    if len(teardowns) == 1:
        raise RuntimeError("the teardown failed")


async def test_a_yield_dependencys_teardown_runs_inside_the_claim(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """docs/fastapi.md: the code after a dependency's `yield` runs before the held response
    leaves. It writes in the claim; when it raises, the client gets a 500, the handler's write
    rolls back and the retry runs again."""
    app = FastAPI()
    teardowns: list[str] = []
    app.state.teardowns = teardowns

    @app.post("/orders")
    async def create(
        conn: IdempotencyConnection, uow: Annotated[None, Depends(unit_of_work)]
    ) -> dict[str, int]:
        await conn.execute(INSERT, f"handler-{len(teardowns)}")
        return {"ok": 1}

    install(app, store=pg_store, tenant_resolver=lambda scope: "t")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        statuses = [
            (await client.post("/orders", headers={"Idempotency-Key": "k"})).status_code
            for _ in range(3)
        ]
    assert statuses == [500, 200, 200]
    assert teardowns == ["teardown-0", "teardown-1"]  # the third was a replay
    rows = await pool.fetch("SELECT account_id FROM test_accounts ORDER BY account_id")
    assert [r["account_id"] for r in rows] == ["handler-1", "teardown-1"]
