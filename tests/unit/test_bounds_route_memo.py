"""What a client can make the route candidates' memo keep by the methods it sends. Any token is a
method to a server (uvicorn's h11 takes one of 60 KB): each made-up method was kept, with its
whole text, as a key of the memo, 1,024 of them (60 MB) until the memo started over; and many
short ones started it over, so that the app's own methods were worked out again and again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore


async def pay(request: Request) -> Response:
    await request.body()
    return JSONResponse({"ok": True}, status_code=201)


def guarded_app() -> tuple[IdempotencyMiddleware, Starlette]:
    app = Starlette(
        routes=[
            Route("/pay/{id}", pay, methods=["POST"]),
            Route("/things", pay, methods=["POST", "PUT"]),
        ]
    )
    return IdempotencyMiddleware(app, store=MemoryStore(), tenant_resolver=lambda scope: "t"), app


async def status_of(app: Any, method: str, path: str, key: bytes = b"k") -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"idempotency-key", key)],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.Event().wait()  # pragma: no cover - the app never reads past the body
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


def test_long_made_up_methods_are_not_kept() -> None:
    mw, _ = guarded_app()

    async def drive() -> None:
        assert await status_of(mw, "POST", "/things", b"first") == 201
        for n in range(300):
            assert await status_of(mw, f"X{n:04d}" + "A" * 10_000, "/things") == 405

    asyncio.run(drive())
    kept = mw._route_memo.candidates
    held = sum(len(method) for _, method in kept)
    assert held < 2_000, f"{len(kept)} methods kept, {held} characters"


def test_many_short_made_up_methods_do_not_start_the_memo_over() -> None:
    mw, app = guarded_app()

    async def drive() -> tuple[Any, Any]:
        assert await status_of(mw, "POST", "/pay/1", b"first") == 201
        (post,) = [entry for (_, method), entry in mw._route_memo.candidates.items()]
        for n in range(3_000):
            assert await status_of(mw, f"X{n}", f"/pay/{n}") == 405
        assert await status_of(mw, "POST", "/pay/2", b"second") == 201  # still guarded
        return post, mw._route_memo.candidates.get((id(app.router.routes), "POST"))

    post, after = asyncio.run(drive())
    assert after is post  # the app's own method's candidates, never worked out again
    assert len(mw._route_memo.candidates) <= 1 + 32


def test_long_made_up_methods_are_not_kept_per_included_router() -> None:
    """An included FastAPI router kept the routes each of the first 32 methods could reach,
    under the method's whole text: 32 methods of 60 KB to each of 20 routers held 38 MB."""
    fastapi = pytest.importorskip("fastapi")
    app = fastapi.FastAPI()

    async def thing() -> dict[str, bool]:
        return {"ok": True}

    for n in range(3):
        router = fastapi.APIRouter()
        router.post(f"/things{n}/{{id}}")(thing)
        app.include_router(router, prefix=f"/api{n}")
    mw = IdempotencyMiddleware(app, store=MemoryStore(), tenant_resolver=lambda scope: "t")

    async def drive() -> None:
        for n in range(3):
            assert await status_of(mw, "POST", f"/api{n}/things{n}/1", f"k{n}".encode()) == 200
            for m in range(40):
                method = f"X{m:03d}" + "A" * 10_000
                assert await status_of(mw, method, f"/api{n}/things{n}/1") == 405

    asyncio.run(drive())
    included = mw._route_memo.included.values()
    assert len(included) == 3
    held = sum(len(method) for entry in included for method in entry[3])
    assert held < 3 * 2_000, f"{held} characters of methods kept"


def test_made_up_methods_are_kept_up_to_32_characters() -> None:
    """The bound itself (`_KEPT_METHOD_LENGTH`): a method of 32 characters is kept, of 33 not."""
    fastapi = pytest.importorskip("fastapi")
    app = fastapi.FastAPI()

    async def thing() -> dict[str, bool]:
        return {"ok": True}

    router = fastapi.APIRouter()
    router.post("/things/{id}")(thing)
    app.include_router(router, prefix="/api")
    mw = IdempotencyMiddleware(app, store=MemoryStore(), tenant_resolver=lambda scope: "t")
    at, over = "M" * 32, "N" * 33

    async def drive() -> None:
        for method in (at, over):
            assert await status_of(mw, method, "/api/things/1") == 405

    asyncio.run(drive())
    assert at in {method for _, method in mw._route_memo.candidates}
    assert over not in {method for _, method in mw._route_memo.candidates}
    [entry] = mw._route_memo.included.values()
    assert at in entry[3]
    assert over not in entry[3]
