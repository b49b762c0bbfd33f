"""A sub-app with its own middleware, mounted behind a wrapper whose `.app` is another app (a
dispatcher that picks one of two by a header): the top router's view of the path reaches the
other app's route. Its name is not taken for the request's: the endpoint the top router's view
finds must be the one the middleware found, else that route's `@not_idempotent` (or policy)
would apply to a guarded route (it ran unguarded)."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, not_idempotent
from tests.apps import BearerBackend, client, key


def switched_app(ran: list[str]) -> Any:
    @not_idempotent
    async def free(request: Request) -> PlainTextResponse:
        ran.append("free")
        return PlainTextResponse("free")

    async def paid(request: Request) -> PlainTextResponse:
        ran.append("paid")
        return PlainTextResponse("paid")

    open_app = Starlette(routes=[Route("/pay", free, methods=["POST"])])
    guarded_app = Starlette(
        routes=[Route("/pay", paid, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )

    class Switch:
        """Dispatches to `guarded_app` when the request says so; `.app` is the other one."""

        def __init__(self) -> None:
            self.app = open_app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            chosen = guarded_app if (b"x-guarded", b"1") in scope["headers"] else open_app
            await chosen(scope, receive, send)

    return Starlette(routes=[Mount("/v1", app=Switch())])


async def test_a_route_the_top_router_names_otherwise_keeps_the_found_endpoints_policy() -> None:
    ran: list[str] = []
    app = switched_app(ran)
    guarded = {"x-guarded": "1"}
    async with client(app) as c:
        unkeyed = await c.post("/v1/pay", content=b"{}", headers=guarded)
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        assert ran == []
        first = await c.post("/v1/pay", content=b"{}", headers={**guarded, **key("s1")})
        again = await c.post("/v1/pay", content=b"{}", headers={**guarded, **key("s1")})
        assert first.text == again.text == "paid"
        assert again.headers.get("idempotent-replayed") == "true"
        assert ran == ["paid"]
