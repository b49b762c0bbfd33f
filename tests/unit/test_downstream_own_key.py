"""Pinned: the downstream hook never replaces a key the caller set on its own request
(downstream.add_downstream_key: "unless it already has one"), whatever its case; a request
without one, made in the same operation, carries the operation's downstream key."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, get_context
from idem_middleware.downstream import downstream_hooks


async def test_a_key_the_caller_set_is_sent_as_it_is() -> None:
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("idempotency-key"))
        return httpx.Response(200)

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(answer), event_hooks=downstream_hooks()
    ) as bank:

        async def pay(request: Request) -> Response:
            await bank.post("http://bank/a", headers={"Idempotency-Key": "mine"})
            await bank.post("http://bank/b", headers={"idempotency-key": "lower"})
            await bank.post("http://bank/c")
            return PlainTextResponse(get_context(request).downstream_key, 201)

        app: Any = Starlette(
            routes=[Route("/pay", pay, methods=["POST"])],
            middleware=[
                Middleware(
                    IdempotencyMiddleware,
                    store=MemoryStore(),
                    default_policy=Policy(allow_anonymous=True),
                )
            ],
        )
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            response = await c.post("/pay", json={}, headers={"idempotency-key": "k1"})
    assert response.status_code == 201, response.text
    assert seen == ["mine", "lower", response.text]
