"""A key read from the body of a client that left before sending it: no key can be found and
no app runs for that client, even where the key is optional (it is not taken for a request
with no key and passed on unguarded)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import MemoryStore, Mode, Policy
from idem_middleware.keysource import KeyFromBody
from tests.apps import BOUND, one_route_app, post_scope


async def test_a_body_key_of_a_client_gone_before_its_body_runs_no_app() -> None:
    runs: list[int] = []

    async def pay(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({}, status_code=201)

    policy = Policy(key_source=KeyFromBody("/id"), key_required=False)
    app = one_route_app("/pay", pay, store=MemoryStore(), default_policy=policy)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"host", b"test"), (b"authorization", b"Bearer demo-a")]
    await asyncio.wait_for(app(post_scope("/pay", headers), receive, send), BOUND)
    assert runs == []


async def test_a_body_key_hands_the_body_over_once_then_the_clients_disconnect() -> None:
    """The body a key was read from is handed to the app again, once; after it, the server's
    own messages: here the client's disconnect, which a lease-mode handler (run to its end,
    not cancelled) reads. Handed over again and again, the body's copies hid the disconnect
    from the app and from the middleware's own watch; never handed over, the handler waited
    for a body already read."""
    seen: list[Any] = []

    async def pay(request: Request) -> Response:
        seen.append(await request.body())
        try:
            seen.append((await asyncio.wait_for(request.receive(), 2))["type"])
        except TimeoutError:
            seen.append("no disconnect seen")
        return JSONResponse({}, status_code=201)

    policy = Policy(key_source=KeyFromBody("/id"), mode=Mode.LEASE)
    app = one_route_app("/pay", pay, store=MemoryStore(), default_policy=policy)
    body = b'{"id": "k1", "amount": 5}'
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    headers = [
        (b"host", b"test"),
        (b"authorization", b"Bearer demo-a"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await asyncio.wait_for(app(post_scope("/pay", headers), receive, send), BOUND)
    assert seen == [body, "http.disconnect"]
