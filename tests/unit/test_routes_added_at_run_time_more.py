"""Routes added at run time where the middleware's memos, not only its route cache, must see
them: a route added to an app that already has several (its route candidates, worked out once
per list, are worked out again when the list grows), and one added to an included router that
is its app's only route (no candidates are filed then: the route cache holds the path only
while the included router's list keeps its length). Missed, either ran unguarded (fail open)."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.fastapi import install
from tests.apps import BearerBackend, client, key


def counted(name: str, calls: Counter[str]):  # type: ignore[no-untyped-def]
    async def handler(request: Request) -> JSONResponse:
        calls[name] += 1
        return JSONResponse({"call": calls[name]}, status_code=201)

    return handler


async def test_a_route_added_to_a_list_of_several_is_guarded() -> None:
    calls: Counter[str] = Counter()
    app = Starlette(
        routes=[
            Route("/other", counted("other", calls), methods=["POST"]),
            Route("/more", counted("more", calls), methods=["POST"]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    async with client(app) as http:
        for _ in range(2):  # (twice: the route cache keeps a path from its second request)
            assert (await http.post("/pay", json={}, headers=key("k"))).status_code == 404
        app.router.add_route("/pay", counted("pay", calls), methods=["POST"])
        unkeyed = await http.post("/pay", json={})
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        first = await http.post("/pay", json={"a": 1}, headers=key("k"))
        again = await http.post("/pay", json={"a": 1}, headers=key("k"))
    assert first.status_code == 201, first.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert calls["pay"] == 1


async def test_a_route_added_to_an_apps_only_included_router_is_guarded() -> None:
    calls: Counter[str] = Counter()
    app = FastAPI(openapi_url=None)  # (no docs routes: the included router is the only route)
    router = APIRouter(prefix="/orders")

    @router.post("/first", status_code=201)
    async def first_route() -> dict[str, str]:
        return {}

    app.include_router(router, prefix="/api")
    assert len(app.router.routes) == 1
    install(app, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    async with client(app) as http:
        for _ in range(2):  # (twice: the route cache keeps a path from its second request)
            assert (
                await http.post("/api/orders/late", json={}, headers=key("k"))
            ).status_code == 404

        @router.post("/late", status_code=201)
        async def late() -> dict[str, int]:
            calls["late"] += 1
            return {"call": calls["late"]}

        unkeyed = await http.post("/api/orders/late", json={})
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        first = await http.post("/api/orders/late", json={"a": 1}, headers=key("k"))
        again = await http.post("/api/orders/late", json={"a": 1}, headers=key("k"))
    assert first.status_code == 201, first.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert calls["late"] == 1


async def test_a_route_added_to_a_router_included_in_an_included_router_is_guarded() -> None:
    calls: Counter[str] = Counter()
    app = FastAPI()
    outer, inner = APIRouter(prefix="/orders"), APIRouter(prefix="/inner")

    @inner.post("/first", status_code=201)
    async def first_route() -> dict[str, str]:
        return {}

    outer.include_router(inner)
    app.include_router(outer, prefix="/api")
    install(app, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    path = "/api/orders/inner/late"
    async with client(app) as http:
        for _ in range(2):  # (twice: the route cache keeps a path from its second request)
            assert (await http.post(path, json={}, headers=key("k"))).status_code == 404

        @inner.post("/late", status_code=201)
        async def late() -> dict[str, int]:
            calls["late"] += 1
            return {"call": calls["late"]}

        unkeyed = await http.post(path, json={})
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        first = await http.post(path, json={"a": 1}, headers=key("k"))
        again = await http.post(path, json={"a": 1}, headers=key("k"))
    assert first.status_code == 201, first.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert calls["late"] == 1
