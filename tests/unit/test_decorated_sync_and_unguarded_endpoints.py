"""`@idempotent` on a plain (sync) function endpoint refuses to run where no middleware guarded
its request, as an `async def` one does (Starlette runs a sync endpoint in a thread: the
refusal must hold there too, or it runs unguarded); and `@idempotent(guard=False)` exempts its
endpoint like `@not_idempotent`, with no wrapper that would refuse the unguarded request."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware import ConfigurationError, IdempotencyMiddleware, MemoryStore
from idem_middleware.endpoints import idempotent
from tests.apps import client, key
from tests.apps.clients import BearerBackend


def _guarded(routes: list[Any]) -> Starlette:
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )


class _Wrapper:
    """ASGI middleware that keeps what it wraps to itself: the middleware cannot see past it."""

    def __init__(self, inner: ASGIApp) -> None:
        self._inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._inner(scope, receive, send)


async def test_a_decorated_sync_endpoint_the_middleware_cannot_see_refuses_to_run() -> None:
    runs: list[int] = []

    @idempotent()
    def refund(request: Request) -> JSONResponse:  # (a sync endpoint: run in a thread)
        runs.append(1)
        return JSONResponse({"runs": len(runs)}, status_code=201)

    sub = Starlette(routes=[Route("/refund", refund, methods=["POST"])])
    app = _guarded([Mount("/v2", app=_Wrapper(sub))])
    async with client(app) as c:
        refused = await c.post("/v2/refund", json={"a": 1}, headers=key("k1"))
    assert refused.status_code == 500
    assert runs == []
    raising = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=sub),  # no middleware at all
        base_url="http://test",
    )
    async with raising as c:
        with pytest.raises(ConfigurationError, match="no IdempotencyMiddleware handled"):
            await c.post("/refund", json={"a": 1})
    assert runs == []


async def test_an_endpoint_decorated_guard_false_runs_unguarded() -> None:
    runs: list[int] = []

    @idempotent(guard=False)
    async def search(request: Request) -> JSONResponse:
        runs.append(1)
        return JSONResponse({"runs": len(runs)})

    app = _guarded([Route("/search", search, methods=["POST"])])
    async with client(app) as c:
        first = await c.post("/search", json={})  # no key: not guarded, not refused
        second = await c.post("/search", json={}, headers=key("k1"))
        third = await c.post("/search", json={}, headers=key("k1"))  # not replayed: run again
    assert [r.status_code for r in (first, second, third)] == [200, 200, 200]
    assert third.headers.get("idempotent-replayed") is None
    assert runs == [1, 1, 1]
