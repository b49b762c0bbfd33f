"""A large app's route candidates under methods a client makes up: any token is a method to a
server, and the candidates of one outside HTTP's own are kept only for the first few short ones.
For every other, each request filed the app's routes by their paths again, compiling each
route's regex anew (Python's `re` cache holds 512): at 5,000 routes in included routers, 0.4 s
of a worker per request, twenty times the app's own routing of it. A route's path is read once."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.responses import PlainTextResponse

import idem_middleware.route_candidates as route_candidates
from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy

ROUTES = 200


def big_app() -> FastAPI:
    app = FastAPI()
    for group in range(ROUTES // 20):
        outer, inner = APIRouter(prefix=f"/g{group}"), APIRouter(prefix="/inner")
        for i in range(20):

            async def handler() -> PlainTextResponse:
                return PlainTextResponse("ran")

            router = inner if i % 2 else outer
            router.add_api_route(f"/r{i}/{{id:int}}", handler, methods=["POST"], name=f"r{i}")
        outer.include_router(inner)
        app.include_router(outer)
    for i in range(ROUTES // 4):  # (and plain routes of the app's own)

        async def own() -> PlainTextResponse:
            return PlainTextResponse("ran")

        app.add_api_route(f"/own{i}/{{id}}", own, methods=["POST"], name=f"own{i}")
    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), default_policy=Policy(allow_anonymous=True)
    )
    return app


async def status_of(app: Any, method: str, path: str) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "headers": [(b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    return statuses[0]


def test_made_up_methods_do_not_read_every_route_again(monkeypatch: Any) -> None:
    app = big_app()
    compiled: list[str] = []
    real = route_candidates.compile_path

    def counting(path: str) -> Any:
        compiled.append(path)
        return real(path)

    monkeypatch.setattr(route_candidates, "compile_path", counting)

    async def scenario() -> None:
        assert await status_of(app, "POST", "/g0/r0/1") == 400  # guarded: no key
        assert await status_of(app, "PUT", "/g0/r0/1") == 405
        once = len(compiled)
        assert once > 0
        # Long made-up methods (never kept), and many short ones (past the kept budget).
        methods = [f"M{i:02d}".ljust(40, "Z") for i in range(10)]
        methods += [f"X{i:02d}" for i in range(50)]
        for i, method in enumerate(methods):
            assert await status_of(app, method, f"/g{i % 10}/r0/{i}") == 405
            assert await status_of(app, method, f"/own{i % 50}/{i}") == 405
        assert len(compiled) - once <= ROUTES, (once, len(compiled))

    asyncio.run(scenario())


def test_methods_not_kept_are_not_filed_by_path(monkeypatch: Any) -> None:
    """Past the kept ones, a made-up method's candidates are the routes that may take it, in
    order, without the trie (whose filing reads every route's path, at every request)."""
    app = big_app()
    filed: list[Any] = []
    real = route_candidates._literal_prefix

    def counting(path: Any, regex: Any) -> tuple[str, ...]:
        filed.append(path)
        return real(path, regex)

    monkeypatch.setattr(route_candidates, "_literal_prefix", counting)

    async def scenario() -> None:
        for i in range(40):  # (the kept budget used up)
            await status_of(app, f"K{i:02d}", "/g0/r0/1")
        before = len(filed)
        for i in range(20):
            method = f"L{i:02d}".ljust(40, "Z") if i % 2 else f"S{i:02d}"
            assert await status_of(app, method, f"/g{i % 10}/r0/{i}") == 405
        assert len(filed) == before

    asyncio.run(scenario())


def test_a_route_of_a_made_up_method_is_guarded_past_the_kept_ones() -> None:
    """The routes that take a made-up method are still found (and guarded) when its candidates
    are not kept: a plain route's, and an included router's."""
    long_method = "VERSION-CONTROL-" + "X" * 30
    ran: list[str] = []
    app = FastAPI()
    router = APIRouter(prefix="/v")

    async def handler() -> PlainTextResponse:
        ran.append("ran")
        return PlainTextResponse("ran")

    router.add_api_route("/items/{id}", handler, methods=[long_method, "SHORT"])
    app.include_router(router)
    app.add_api_route("/own/{id}", handler, methods=[long_method, "SHORT"])
    for i in range(ROUTES):
        app.add_api_route(f"/other{i}/{{id}}", handler, methods=["POST"])
    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        default_policy=Policy(allow_anonymous=True),
        methods=("POST", long_method, "SHORT"),
    )

    async def scenario() -> None:
        for i in range(40):  # (the kept budget used up)
            await status_of(app, f"K{i:02d}", "/v/items/1")
        for method in (long_method, "SHORT"):
            for path in ("/v/items/1", "/own/1", "/v/items/2", "/own/2"):
                assert await status_of(app, method, path) == 400, (method, path)
        assert ran == []

    asyncio.run(scenario())
