"""A request the server cancels (its shutdown, past the graceful timeout) is answered `503
request-cancelled` before the cancellation goes on: but a server that no longer takes messages
(hypercorn's HTTP/2 stream, its sender cancelled already) never returns from `send`, and the
cancellation must not wait on it for ever."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.responses import Response

from idem_middleware import MemoryStore, Policy, responses
from idem_middleware.policy import Mode
from tests.apps import asgi_request, one_route_app

pytestmark = pytest.mark.asyncio

BODY = b'{"amount": 5}'


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_cancelled_requests_answer_is_bounded_when_the_server_takes_none(
    mode: Mode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(responses, "CANCELLED_SEND_SECONDS", 0.05)
    entered = asyncio.Event()

    async def handler(request: Request) -> Response:
        await request.body()
        entered.set()
        await asyncio.Event().wait()  # until cancelled
        raise AssertionError("not reached")

    app = one_route_app("/pay", handler, store=MemoryStore(), default_policy=Policy(mode=mode))
    attempted: list[int] = []

    async def send(message: dict[str, object]) -> None:
        if message["type"] == "http.response.start":
            attempted.append(message["status"])  # type: ignore[arg-type]
        await asyncio.Event().wait()  # a server that takes nothing more

    delivered = False

    async def receive() -> dict[str, object]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("not reached")

    scope = asgi_request("/pay", "k-cancelled", len(BODY))
    task = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=3)
    assert done, "the cancellation waited on a send the server never took"
    assert task.cancelled()
    assert attempted == [503]  # it was tried: request-cancelled
