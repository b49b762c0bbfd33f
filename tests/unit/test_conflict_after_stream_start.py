"""A conflict (RetryableConflict) raised after a transactional stream started (its outcome
committed before its first byte) ends the response as an error does: nothing can be said to
the client any more, so no problem (409) is sent after the stream's own start, and the attempt
does not run again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from idem_middleware.errors import RetryableConflict
from idem_middleware.store.base import RecordKey, State
from tests.apps import BOUND

pytestmark = pytest.mark.asyncio


async def test_a_conflict_once_the_stream_started_is_raised_not_answered() -> None:
    calls = 0

    async def handler(request: Request) -> StreamingResponse:
        nonlocal calls
        calls += 1

        async def body() -> AsyncIterator[bytes]:
            yield b'{"part": 1}'
            raise RetryableConflict("could not serialize access")  # (a call of its own's)

        # (an event stream is never held: its outcome is recorded before its first byte)
        return StreamingResponse(body(), status_code=201, media_type="text/event-stream")

    store = MemoryStore()
    mw = IdempotencyMiddleware(
        Starlette(routes=[Route("/x", handler, methods=["POST"])]),
        store=store,
        default_policy=Policy(mode=Mode.TRANSACTIONAL),
        tenant_resolver=lambda scope: "t",
    )
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/x",
        "raw_path": b"/x",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"k"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    incoming = [{"type": "http.request", "body": b"{}", "more_body": False}]
    sent: list[dict[str, Any]] = []
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await never.wait()  # (the client stays)
        return {"type": "http.disconnect"}  # pragma: no cover

    async def send(message: Any) -> None:
        sent.append(message)

    with pytest.raises(RetryableConflict):
        await asyncio.wait_for(mw(scope, receive, send), BOUND)
    starts = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert starts == [201]  # the stream's own start, and nothing after it
    assert b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body") == (
        b'{"part": 1}'
    )
    assert calls == 1
    record = await store.get(RecordKey("t", "POST /x", "k"))
    assert record is not None
    assert record.state is State.SUCCEEDED
