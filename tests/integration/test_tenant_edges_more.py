"""Tenant resolution edges no test pinned: an ASCII tenant of exactly `MAX_TENANT_BYTES` is
guarded (the ASCII fast path's bound, as the UTF-8 one's is); a NUL in a non-ASCII tenant and an
unstorable answer of an async resolver are refused before the claim, as a sync resolver's are;
a resolver that raises when asked again before an anonymous claim's outcome is recorded counts
as naming a caller (refused, never recorded as anonymous); and a 5xx HTTPException from the
status route's resolver is not answered as a refusal (it goes on to the server's handling)."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy, PostgresStore
from idem_middleware.status import status_route
from idem_middleware.store.base import State
from idem_middleware.tenant import MAX_TENANT_BYTES
from tests.apps import assert_problem, key


def _app(store: Any, resolver: Any, calls: list[str], **policy: Any) -> Starlette:
    async def pay(request: Request) -> Response:
        calls.append("pay")
        return JSONResponse({"n": len(calls)}, status_code=201)

    return Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                tenant_resolver=resolver,
                default_policy=Policy(**policy),
            )
        ],
    )


async def _post(app: Starlette) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.post("/pay", headers=key("k"), content=b"{}")


async def _records(store: MemoryStore | PostgresStore) -> list[Any]:
    return list(await store.list_records(states=list(State)))


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_an_ascii_tenant_of_the_most_bytes_is_guarded(
    store: MemoryStore | PostgresStore, mode: Mode
) -> None:
    tenant = secrets.token_hex(MAX_TENANT_BYTES // 2)  # (incompressible)
    assert len(tenant) == MAX_TENANT_BYTES
    calls: list[str] = []
    app = _app(store, lambda scope: tenant, calls, mode=mode)
    first, again = await _post(app), await _post(app)
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert calls == ["pay"]


async def _async_answer(value: str) -> str:
    return value


@pytest.mark.parametrize(
    "resolver",
    [
        lambda scope: "t\u00e9\x00nant",  # a NUL in a tenant that is not ASCII
        lambda scope: _async_answer("x" * (MAX_TENANT_BYTES + 1)),  # an async resolver's
        lambda scope: _async_answer("t\x00"),
    ],
    ids=["utf8-nul", "async-long", "async-nul"],
)
async def test_an_unstorable_tenant_is_refused_before_the_claim(
    store: MemoryStore | PostgresStore, resolver: Any
) -> None:
    calls: list[str] = []
    app = _app(store, resolver, calls)
    answer = await _post(app)
    assert "cannot identify" in assert_problem(answer, 500, "server-misconfigured")["detail"]
    assert calls == []
    assert await _records(store) == []


class RaisesLater:
    """Inside the middleware: marks the request so that the resolver, asked again at the
    settlement, raises (a resolver that fails once authentication inside has run)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["late"] = True
        await self.app(scope, receive, send)


def _raises_later(scope: Scope) -> str | None:
    if (scope.get("state") or {}).get("late"):
        raise RuntimeError("the resolver cannot say now")
    return None


async def test_a_resolver_that_raises_at_the_settlement_of_an_anonymous_claim_is_refused() -> None:
    store = MemoryStore()
    calls: list[str] = []

    async def pay(request: Request) -> Response:
        calls.append("pay")
        return JSONResponse({"n": len(calls)}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                tenant_resolver=_raises_later,
                default_policy=Policy(allow_anonymous=True),
            ),
            Middleware(RaisesLater),  # (listed after: runs inside the middleware)
        ],
    )
    first = await _post(app)
    assert_problem(first, 500, "server-misconfigured")
    assert [r for r in await _records(store) if r.state is State.SUCCEEDED] == []


async def test_a_5xx_from_the_status_routes_resolver_is_not_answered_as_a_refusal() -> None:
    def unavailable(scope: Scope) -> str:
        raise HTTPException(503, "the identity provider is down")

    app = Starlette(routes=[status_route(MemoryStore(), tenant_resolver=unavailable)])
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.get("/idempotency/status", params={"operation": "POST /pay", "key": "k"})
    assert r.status_code == 503
    assert not r.headers.get("content-type", "").startswith("application/problem+json"), r.text
