"""FastAPI's streaming `yield` path operations behind the middleware, on PostgreSQL.

An `EventSourceResponse` generator's body runs in a task of FastAPI's own, beside the response,
which starts (and so settles the claim) before the generator's first event: the claim's
connection or session taken as its parameter raced the settlement (transactional: a 500 on every
request, "another operation is in progress"). Refused at startup now; a dependency, which runs
before the response, writes in the claim as in any handler."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable
from typing import Annotated, Any

import asyncpg
import httpx
import pytest
from fastapi import Depends, FastAPI
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.types import Message

from idem_middleware import ConfigurationError
from idem_middleware.fastapi import Idempotency, IdempotencyConnection, install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore

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
