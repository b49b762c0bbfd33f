"""Mutants of middleware_order.py's latest change (`_inside` finds the guarded routes by endpoint
and template) killed: a route is on the way to a guarded one when its template is that route's,
not whenever its endpoint is a guarded route's too. One handler serving a guarded `POST /pay`
and a `GET /receipt` with its own authentication is no authentication inside the middleware,
beside a Host too (where the template is matched by its ending)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Host, Mount, Route, Router
from starlette.types import Message

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from tests.apps.clients import BearerBackend

pytestmark = pytest.mark.asyncio

AUTH = Middleware(AuthenticationMiddleware, backend=BearerBackend())


async def pay(request: Request) -> Response:
    return JSONResponse({"paid": True}, status_code=201)


async def _startup(app: Any) -> list[Message]:
    sent: list[Message] = []
    incoming = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive() -> Message:
        return next(incoming)

    async def send(message: Message) -> None:
        sent.append(message)

    with contextlib.suppress(Exception):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    return sent


def _routes(where: str, receipt_auth: bool) -> list[BaseRoute]:
    middleware = [AUTH] if receipt_auth else []
    routes: list[BaseRoute] = [
        Route("/pay", pay, methods=["POST"]),
        Route("/receipt", pay, methods=["GET"], middleware=middleware),
    ]
    return routes if where == "app" else [Host("api.example", app=Router(routes))]


@pytest.mark.parametrize("where", ["app", "host"])
async def test_middleware_on_an_unguarded_route_of_a_guarded_endpoint_is_not_inside(
    where: str,
) -> None:
    app = Starlette(routes=_routes(where, receipt_auth=True))
    policy = Policy(allow_anonymous=True)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=policy)
    sent = await _startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


@pytest.mark.parametrize("where", ["app", "host"])
async def test_middleware_on_the_guarded_route_itself_still_is(where: str) -> None:
    routes: list[BaseRoute] = [
        Route("/pay", pay, methods=["POST"], middleware=[AUTH]),
        Route("/receipt", pay, methods=["GET"]),
    ]
    if where == "host":
        routes = [Host("api.example", app=Router(routes))]
    app = Starlette(routes=routes)
    policy = Policy(allow_anonymous=True)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=policy)
    sent = await _startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    declared = "/pay" if where == "app" else "api.example/pay"
    assert f"AuthenticationMiddleware is declared on {declared} (" in sent[0]["message"]


async def test_middleware_inside_an_included_router_under_a_mount_is_named_with_the_mount() -> None:
    """A FastAPI app mounted at `/api` of the app the middleware wraps: what its included router
    mounts is declared on `/api/v1/sub`, not on `/v1/sub` (the mount's prefix kept)."""
    fastapi = pytest.importorskip("fastapi")
    router = fastapi.APIRouter()
    router.mount(
        "/sub", Starlette(routes=[Route("/pay", pay, methods=["POST"])], middleware=[AUTH])
    )
    api = fastapi.FastAPI(openapi_url=None)
    api.include_router(router, prefix="/v1")
    app = Starlette(routes=[Mount("/api", app=api)])
    policy = Policy(allow_anonymous=True)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=policy)
    sent = await _startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "AuthenticationMiddleware is declared on /api/v1/sub (" in sent[0]["message"]
