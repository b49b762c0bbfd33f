"""Every routing construct Starlette and FastAPI offer is guarded under its own template: a key
is required, a duplicate runs the handler once, and the record names the right operation.

Route, Mount(routes=...), Host, nested Routers, an included APIRouter with prefixes, a mounted
Starlette app, a mounted FastAPI app, a mounted app behind middleware, and a mounted app with its
own IdempotencyMiddleware. A route the middleware cannot name is refused, never run unguarded.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Host, Match, Mount, Route, Router
from starlette.types import Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, idempotent, not_idempotent
from idem_middleware.fastapi import install
from idem_middleware.store.postgres import PostgresStore
from tests.apps import BearerBackend, assert_problem, assert_replay_of, key

CALLS: Counter[str] = Counter()


def starlette_handler(name: str) -> Any:
    async def handler(request: Request) -> Response:
        CALLS[name] += 1
        return JSONResponse({"construct": name, "call": CALLS[name]}, status_code=201)

    return handler


def build(store: PostgresStore) -> FastAPI:
    app = FastAPI()

    @app.post("/plain/pay", status_code=201)
    async def plain() -> dict[str, Any]:
        CALLS["route"] += 1
        return {"call": CALLS["route"]}

    router = APIRouter(prefix="/orders")

    @router.post("/{order_id}/pay", status_code=201)
    async def order_pay(order_id: int) -> dict[str, Any]:
        CALLS["apirouter"] += 1
        return {"order": order_id, "call": CALLS["apirouter"]}

    app.include_router(router, prefix="/api")

    fastapi_sub = FastAPI()

    @fastapi_sub.post("/pay", status_code=201)
    async def sub_pay() -> dict[str, Any]:
        CALLS["fastapi-sub"] += 1
        return {"call": CALLS["fastapi-sub"]}

    app.mount("/v3", fastapi_sub)
    app.mount(
        "/v2",
        Starlette(routes=[Route("/pay", starlette_handler("starlette-sub"), methods=["POST"])]),
    )
    app.mount(
        "/wrapped",
        GZipMiddleware(
            Starlette(routes=[Route("/pay", starlette_handler("wrapped"), methods=["POST"])])
        ),
    )
    own = Starlette(
        routes=[Route("/pay", starlette_handler("own-middleware"), methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
    )
    app.mount("/own", own)
    app.router.routes.extend(
        [
            Host(
                "api.example",
                app=Router([Route("/pay", starlette_handler("host"), methods=["POST"])]),
            ),
            Mount("/v1", routes=[Route("/pay", starlette_handler("mount"), methods=["POST"])]),
            Mount(
                "/a",
                routes=[
                    Mount(
                        "/b",
                        app=Router(
                            [Route("/pay/{n:int}", starlette_handler("nested"), methods=["POST"])]
                        ),
                    )
                ],
            ),
        ]
    )
    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


#: (construct, base URL, path, the operation its record names)
CONSTRUCTS = [
    ("route", "http://test", "/plain/pay", "POST /plain/pay"),
    ("apirouter", "http://test", "/api/orders/7/pay", "POST /api/orders/{order_id}/pay"),
    ("host", "http://api.example", "/pay", "POST api.example/pay"),
    ("mount", "http://test", "/v1/pay", "POST /v1/pay"),
    ("nested", "http://test", "/a/b/pay/3", "POST /a/b/pay/{n:int}"),
    ("starlette-sub", "http://test", "/v2/pay", "POST /v2/pay"),
    ("fastapi-sub", "http://test", "/v3/pay", "POST /v3/pay"),
    ("wrapped", "http://test", "/wrapped/pay", "POST /wrapped/pay"),
    ("own-middleware", "http://test", "/own/pay", "POST /own/pay"),
]


def client(app: Any, base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url=base_url,
        headers={"authorization": "Bearer demo-a"},
    )


@pytest.mark.parametrize(("construct", "base_url", "path", "operation"), CONSTRUCTS)
async def test_every_routing_construct_is_guarded_under_its_template(
    pg_store: PostgresStore,
    pool: asyncpg.Pool[Any],
    construct: str,
    base_url: str,
    path: str,
    operation: str,
) -> None:
    CALLS.clear()
    app = build(pg_store)
    async with client(app, base_url) as c:
        missing = await c.post(path, json={"amount": 1})
        assert_problem(missing, 400, "missing-key")
        assert CALLS[construct] == 0

        first = await c.post(path, json={"amount": 1}, headers=key(f"k-{construct}"))
        assert first.status_code == 201, first.text
        again = await c.post(path, json={"amount": 1}, headers=key(f"k-{construct}"))
        assert_replay_of(again, first)
    assert CALLS[construct] == 1
    rows = await pool.fetch("SELECT tenant, operation, state FROM idem_requests")
    assert [tuple(r) for r in rows] == [("tenant-a", operation, "succeeded")]


async def test_two_hosts_with_the_same_path_are_two_operations(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    CALLS.clear()
    app = Starlette(
        routes=[
            Host(
                "api.example",
                app=Router([Route("/pay", starlette_handler("api"), methods=["POST"])]),
            ),
            Host(
                "admin.example",
                app=Router([Route("/pay", starlette_handler("admin"), methods=["POST"])]),
            ),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=pg_store),
        ],
    )
    async with (
        client(app, "http://api.example") as api,
        client(app, "http://admin.example") as admin,
    ):
        assert (await api.post("/pay", json={}, headers=key("same"))).status_code == 201
        second = await admin.post("/pay", json={}, headers=key("same"))
        assert second.status_code == 201
        assert "idempotent-replayed" not in second.headers
    assert Counter({"api": 1, "admin": 1}) == CALLS
    operations = await pool.fetch("SELECT operation FROM idem_requests ORDER BY operation")
    assert [r["operation"] for r in operations] == [
        "POST admin.example/pay",
        "POST api.example/pay",
    ]


class CatchAll(BaseRoute):
    """A custom route with no path: the middleware cannot name what it reaches."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        return Match.FULL, {"endpoint": self.endpoint}

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NotImplementedError

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.endpoint(Request(scope, receive))
        await response(scope, receive, send)


def catch_all_app(store: PostgresStore, endpoint: Any) -> Starlette:
    return Starlette(
        routes=[CatchAll(endpoint)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )


async def test_a_route_the_middleware_cannot_name_is_refused_not_run_unguarded(
    pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    CALLS.clear()
    app = catch_all_app(pg_store, starlette_handler("custom"))
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        async with client(app, "http://test") as c:
            r = await c.post("/anything", json={}, headers=key("k1"))
            assert_problem(r, 500, "server-misconfigured")
            # A safe method is never guarded: it reaches the route.
            assert (await c.get("/anything")).status_code == 201
    assert CALLS["custom"] == 1
    startup = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("CatchAll under /" in m and "@not_idempotent" in m for m in startup), startup


async def test_a_refusal_logs_a_clients_method_cut_short(
    pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: an endpoint's own policy guards any method a route lets through, and
    the refusal's ERROR line showed the client's method whole, at any length, on every request."""
    CALLS.clear()
    app = catch_all_app(pg_store, idempotent()(starlette_handler("custom")))
    method = "PURGE" + "X" * 5000  # a token: any length the server lets in
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        async with client(app, "http://test") as c:
            r = await c.request(method, "/anything", json={}, headers=key("k1"))
            assert_problem(r, 500, "server-misconfigured")
    refused = [m for r in caplog.records if "refused PURGE" in (m := r.getMessage())]
    assert len(refused) == 1
    assert "PURGEXXX" in refused[0]
    assert len(refused[0]) < 500, len(refused[0])
    assert CALLS["custom"] == 0


async def test_an_exempted_route_the_middleware_cannot_name_passes_through(
    pg_store: PostgresStore,
) -> None:
    CALLS.clear()
    app = catch_all_app(pg_store, not_idempotent(starlette_handler("custom")))
    async with client(app, "http://test") as c:
        assert (await c.post("/anything", json={})).status_code == 201
    assert CALLS["custom"] == 1


async def test_a_mounted_application_whose_routes_cannot_be_seen_passes_through(
    pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    async def opaque(scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse({"opaque": True})(scope, receive, send)

    app = Starlette(
        routes=[Mount("/legacy", app=opaque)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=pg_store),
        ],
    )
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        async with client(app, "http://test") as c:
            assert (await c.post("/legacy/x", json={})).json() == {"opaque": True}
    assert any(
        "/legacy" in r.getMessage() and "not guarded" in r.getMessage() for r in caplog.records
    )
