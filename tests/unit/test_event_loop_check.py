"""The middleware runs on asyncio only (its waits, timers and tasks, and asyncpg's). Found by
probing: under another event loop (`hypercorn -k trio`) an app with a `MemoryStore` started
without complaint, then every guarded request failed inside the middleware with a server's
plain 500 ("no running event loop"). The startup now fails, saying why.

Driven here by hand, with no event loop running (as under trio, asyncio finds none)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Message

from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.startup import ON_ANOTHER_LOOP
from tests.apps import post_scope


def _app(runs: list[int]) -> Starlette:
    async def credit(request: Request) -> JSONResponse:
        runs.append(1)
        return JSONResponse({}, 201)

    return Starlette(
        routes=[Route("/credits", credit, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t")
        ],
    )


def _drive(coro: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine that never suspends, without an event loop."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise AssertionError("the coroutine suspended")


def test_a_lifespan_on_another_event_loop_fails_its_startup() -> None:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        sent.append(message)

    with pytest.raises(ConfigurationError, match="asyncio only"):
        _drive(_app([])({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
    assert sent == [
        {"type": "lifespan.startup.failed", "message": f"idem_middleware: {ON_ANOTHER_LOOP}"}
    ]


def test_a_request_on_another_event_loop_is_refused_and_runs_nothing() -> None:
    """No lifespan (the check runs at the first request): a 500 problem for the client, the
    check's error raised for the server to log, and never the handler."""
    runs: list[int] = []
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = post_scope(
        "/credits", [(b"idempotency-key", b"k1"), (b"content-type", b"application/json")]
    )
    with pytest.raises(ConfigurationError, match="asyncio only"):
        _drive(_app(runs)(scope, receive, send))
    assert runs == []
    assert sent[0]["status"] == 500
    assert b"failed its startup check" in b"".join(m.get("body", b"") for m in sent[1:])


def test_a_request_coroutine_made_before_its_loop_runs_is_served() -> None:
    """`asyncio.run(app(scope, receive, send))` (or a sync bridge making the coroutine in
    another thread): the first request's check ran when the coroutine was made, before its loop,
    found no loop, and failed that request and every later one. It runs in the loop now."""
    runs: list[int] = []
    # (The middleware wrapping the app itself, as the README shows: its call, not a coroutine
    # of Starlette's, is what the caller makes outside the loop.)
    inner = _app(runs)
    app = IdempotencyMiddleware(
        Starlette(routes=inner.routes), store=MemoryStore(), tenant_resolver=lambda s: "t"
    )
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"idempotency-key", b"k1"), (b"content-type", b"application/json")]
    for _ in range(2):
        asyncio.run(app(post_scope("/credits", headers), receive, send))
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [201, 201]
    assert runs == [1]  # (the second a replay)
