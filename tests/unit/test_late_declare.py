"""`declare` after the outcome is recorded is refused, not taken and ignored.

Found by probing: a `text/event-stream` response is settled before its first byte (as
documented), and a `declare("unknown")` its generator made afterwards (the export failed half-way)
was taken without a word, the record left `succeeded`; so was a declare on a context kept after
its request ended. Each is a RuntimeError now.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idem_middleware import (
    IdempotencyContext,
    IdempotencyMiddleware,
    MemoryStore,
    Mode,
    Policy,
    get_context,
)
from idem_middleware.store.base import RecordKey, State

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_declare_after_a_streams_first_byte_is_refused(mode: Mode) -> None:
    refused: list[str] = []
    kept: list[IdempotencyContext] = []

    async def events(request: Request) -> Response:
        ctx = get_context(request)
        kept.append(ctx)

        async def stream() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            try:
                ctx.declare("release")
            except RuntimeError as exc:
                refused.append(str(exc))
            yield b"data: 2\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def pay(request: Request) -> Response:
        kept.append(get_context(request))
        return JSONResponse({}, status_code=201)

    store = MemoryStore()
    app = Starlette(
        routes=[Route("/events", events, methods=["POST"]), Route("/pay", pay, methods=["POST"])]
    )
    mw = IdempotencyMiddleware(
        app, store=store, default_policy=Policy(mode=mode), tenant_resolver=lambda scope: "t"
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t") as c:
        streamed = await c.post("/events", json={}, headers={"idempotency-key": "k1"})
        paid = await c.post("/pay", json={}, headers={"idempotency-key": "k2"})
    assert streamed.content == b"data: 1\n\ndata: 2\n\n"
    assert len(refused) == 1
    assert "declare came after this operation's outcome was recorded" in refused[0]
    record = await store.get(RecordKey("t", "POST /events", "k1"))
    assert record is not None
    assert record.state is State.SUCCEEDED  # as recorded at the first byte
    assert paid.status_code == 201
    with pytest.raises(RuntimeError, match="declare came after"):
        kept[-1].declare("release")  # the request ended: its context is spent
