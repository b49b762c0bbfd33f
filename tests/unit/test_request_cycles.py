"""A guarded request leaves nothing for the cyclic garbage collector, and its `send` refuses a
response once the request is over.

The objects of one request refer to each other while it runs (the response's capture and
whoever settles it early). Left in place after the request, such a cycle and the ASGI scope
hanging off it wait for the cyclic collector, whose passes cost more than anything else the
middleware does; so the request path breaks them, or makes none.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.policy import Mode
from tests.apps import asgi_request, build_app, one_route_app
from tests.cycles import collector_off

pytestmark = pytest.mark.asyncio

ROUTES = ["/accounts/a1/credits", "/stream", "/big", "/items"]


def _request(path: str, key: str) -> tuple[Scope, Receive, Send, list[Message]]:
    body = b'{"amount": 5}'
    scope = asgi_request(path, key, len(body))
    sent: list[Message] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays: never a disconnect
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    return scope, receive, send, sent


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("path", ROUTES)
async def test_a_guarded_request_leaves_no_reference_cycle(mode: Mode, path: str) -> None:
    """Held, streamed and too-large responses (the cap is 64 bytes here), fresh and replayed, in
    both modes: with the collector off, nothing of theirs is left for it to collect."""
    app = build_app(MemoryStore(), default_policy=Policy(mode=mode, max_response_bytes=64))
    for i in range(3):  # (the first requests make what the app caches)
        scope, receive, send, _ = _request(path, f"warm-{i}")
        await app(scope, receive, send)
    statuses = []
    with collector_off() as garbage:
        for i in range(5):
            for _ in range(2):  # the claim, then its replay
                scope, receive, send, sent = _request(path, f"k{i}")
                await app(scope, receive, send)
                statuses.append(sent[0]["status"])
    assert garbage.ours == []
    assert set(statuses) == {201 if path in ("/accounts/a1/credits", "/items") else 200}


async def test_a_response_sent_after_its_transactional_request_ended_is_refused() -> None:
    """A handler that leaves a task behind with its `send`: what that task sends later cannot
    be settled any more (the claim's transaction is over), so it is refused, not recorded."""
    kept: list[Send] = []

    class Handler:  # (an ASGI app: Starlette routes a function as a request handler)
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            kept.append(send)
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    app = Starlette(
        routes=[Route("/late", Handler(), methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                tenant_resolver=lambda scope: "tenant-a",
            )
        ],
    )
    scope, receive, send, sent = _request("/late", "k1")
    await app(scope, receive, send)
    assert sent[0]["status"] == 201
    late: dict[str, Any] = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    # (A second start is refused as such before anything looks at the claim.)
    with pytest.raises(RuntimeError, match=r"after the request ended|sent twice"):
        await kept[0](late)
    assert len(sent) == 2  # nothing more reached the client


async def test_a_cancelled_request_leaves_no_reference_cycle() -> None:
    """A request the server cancels while its handler runs (a shutdown, a timeout around the
    app): its task keeps the CancelledError, whose traceback holds the attempt's frame, which
    held the task (about 80 objects a request for the collector)."""
    entered = asyncio.Event()

    async def slow(request: Request) -> Response:
        await request.body()
        entered.set()
        await asyncio.sleep(30)
        return Response(status_code=201)

    app = one_route_app("/slow", slow, store=MemoryStore())

    async def cancelled(key: str) -> None:
        entered.clear()
        scope, receive, send, _ = _request("/slow", key)
        task = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(entered.wait(), 5)
        task.cancel()
        # (As a server awaits it: never for its result, which would let go of its error.)
        await asyncio.wait({task}, timeout=5)
        assert task.cancelled()

    for i in range(3):
        await cancelled(f"warm-{i}")
    with collector_off() as garbage:
        for i in range(5):
            await cancelled(f"k{i}")
    assert garbage.ours == []
