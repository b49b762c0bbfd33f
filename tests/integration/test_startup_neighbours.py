"""What startup says of two arrangements that made guarded work run unguarded or fail every
time, each found by probing: a middleware inside the idempotency middleware that changes the
path or method (requests reached guarded routes unguarded), and a policy or claim dependency on
a websocket route (every connection failed with an error blaming a missing middleware)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, WebSocket
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware import MemoryStore, idempotent
from idem_middleware.errors import ConfigurationError
from idem_middleware.fastapi import Idempotency, install


class StripLocale:
    """`/en/pay` -> `/pay`: the router then finds a route the middleware never matched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/en/"):
            scope = {**scope, "path": scope["path"][3:]}
        await self.app(scope, receive, send)


def _paying_app(inside: type) -> tuple[FastAPI, list[int]]:
    app = FastAPI()
    runs: list[int] = []

    @app.post("/pay")
    async def pay() -> dict[str, int]:
        runs.append(1)
        return {"run": len(runs)}

    if inside is TrustedHostMiddleware:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=["testserver"])
    else:
        app.add_middleware(inside)
    install(app, store=MemoryStore(), tenant_resolver=lambda scope: "t")  # outside the above
    return app, runs


def client(app: FastAPI) -> httpx.AsyncClient:
    """No lifespan: the startup check runs at the first request, its error raised."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


@pytest.mark.parametrize(
    ("inside", "path", "runs", "named"),
    [
        # What the warning is about: the same key runs twice.
        (StripLocale, "/en/pay", [1, 1], "StripLocale"),
        (TrustedHostMiddleware, "/pay", [1], None),  # known to keep the route
    ],
)
async def test_a_middleware_inside_that_may_change_the_route_is_named(
    caplog: pytest.LogCaptureFixture, inside: type, path: str, runs: list[int], named: str | None
) -> None:
    app, ran = _paying_app(inside)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(app) as c:
            for _ in range(2):
                await c.post(path, headers={"Idempotency-Key": "k"})
    assert ran == runs
    warnings = [r.getMessage() for r in caplog.records if "finds a request's route" in r.message]
    expected = f"idempotency: {named} runs after IdempotencyMiddleware"
    assert [w[: len(expected)] for w in warnings] == ([expected] if named else [])


def _websocket_app(declared: str | None) -> FastAPI:
    app = FastAPI()

    @app.post("/pay")
    async def pay() -> dict[str, int]:
        return {}

    if declared == "policy":

        @app.websocket("/ws")
        @idempotent()
        async def with_policy(websocket: WebSocket) -> None:
            await websocket.accept()
            await websocket.close()

    elif declared == "dependency":

        @app.websocket("/ws")
        async def with_claim(websocket: WebSocket, idem: Idempotency) -> None:
            await websocket.accept()
            await websocket.close()

    else:

        @app.websocket("/ws")
        async def plain(websocket: WebSocket) -> None:
            await websocket.accept()
            await websocket.send_text("hi")
            await websocket.close()

    install(app, store=MemoryStore(), tenant_resolver=lambda scope: "t")
    return app


@pytest.mark.parametrize("declared", ["policy", "dependency"])
async def test_a_websocket_route_that_asks_to_be_guarded_fails_the_startup(declared: str) -> None:
    async with client(_websocket_app(declared)) as c:
        with pytest.raises(ConfigurationError, match=r"the websocket route /ws .* never guarded"):
            await c.post("/pay", headers={"Idempotency-Key": "k"})


async def test_a_plain_websocket_route_is_served() -> None:
    app = _websocket_app(None)
    async with client(app) as c:  # (the startup check passes)
        assert (await c.post("/pay", headers={"Idempotency-Key": "k"})).status_code == 200
    sent: list[Any] = []
    incoming = [{"type": "websocket.connect"}]

    async def receive() -> Any:
        if incoming:
            return incoming.pop()
        await asyncio.sleep(0)
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/ws", "headers": [], "query_string": b""}
    await app({**scope, "asgi": {"version": "3.0"}, "scheme": "ws", "root_path": ""}, receive, send)
    assert [m["type"] for m in sent][:2] == ["websocket.accept", "websocket.send"]
