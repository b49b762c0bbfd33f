"""Starlette's and FastAPI's request-body limits (`max_body_size` on an app, router, mount or
route) against the middleware's `max_body_bytes` (idem_middleware/body_limits.py): the middleware
reads the body before the router, so it follows the route's limit itself, and never claims a
request the app then refuses for its size."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, body_limits
from idem_middleware.store import State

OPEN = Policy(allow_anonymous=True)


def starlette_app(store: MemoryStore, policy: Policy = OPEN, **limits: Any) -> Starlette:
    async def create(request: Request) -> JSONResponse:
        return JSONResponse({"n": len(await request.body())}, status_code=201)

    route = Route("/p", create, methods=["POST"], max_body_size=limits.get("route"))
    guard = Middleware(IdempotencyMiddleware, store=store, default_policy=policy)
    routes: list[Any] = [route]
    if "mount" in limits:
        routes = [Mount("/m", routes=[route], max_body_size=limits["mount"])]
    return Starlette(routes=routes, middleware=[guard], max_body_size=limits.get("app"))


def fastapi_app(store: MemoryStore, policy: Policy = OPEN, **limits: Any) -> FastAPI:
    app = FastAPI(max_body_size=limits.get("app"))

    @app.post("/p", status_code=201, max_body_size=limits.get("route"))
    async def create(request: Request) -> dict[str, int]:
        return {"n": len(await request.body())}

    app.add_middleware(IdempotencyMiddleware, store=store, default_policy=policy)
    return app


async def post(app: Any, store: MemoryStore, size: int, path: str = "/p") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with store, httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        headers = {"Idempotency-Key": "k1", "Content-Type": "application/octet-stream"}
        return await c.post(path, content=b"x" * size, headers=headers)


async def records(store: MemoryStore) -> list[State]:
    async with store:
        return [r.state for r in await store.list_records(states=list(State))]


def assert_our_413(response: httpx.Response, cap: int) -> None:
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["detail"] == f"The body may be at most {cap} bytes."


@pytest.mark.parametrize("build", [starlette_app, fastapi_app])
async def test_a_body_over_the_routes_lower_limit_is_our_413_before_any_claim(build: Any) -> None:
    """Was: claimed, then the route's limiter refused the body already read (a 413 of the app's
    after a claim and its release; lease mode's a round trip more)."""
    store = MemoryStore()
    claims: list[object] = []
    claim = store.claim_lease

    async def counted(*args: Any, **kwargs: Any) -> Any:
        claims.append(args)
        return await claim(*args, **kwargs)

    store.claim_lease = counted  # type: ignore[method-assign]
    lease = Policy(allow_anonymous=True, mode="lease")
    response = await post(build(store, lease, route=50), store, 60)
    assert_our_413(response, 50)
    assert claims == []
    assert await records(store) == []


async def test_a_routes_higher_limit_than_the_apps_lets_a_guarded_body_through() -> None:
    """`Starlette(max_body_size=100)` with a `Route(max_body_size=2000)`: the app's limit was
    still in force while the middleware read, and refused a body the route accepts."""
    store = MemoryStore()
    response = await post(starlette_app(store, app=100, route=2000), store, 500)
    assert response.status_code == 201
    assert response.json() == {"n": 500}
    assert await records(store) == [State.SUCCEEDED]


async def test_a_policy_left_at_its_default_follows_a_larger_route_limit() -> None:
    store = MemoryStore()
    size = 1024 * 1024 + 1
    response = await post(starlette_app(store, route=2 * 1024 * 1024), store, size)
    assert response.status_code == 201
    assert response.json() == {"n": size}


async def test_a_policys_own_lower_limit_stands_and_startup_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    policy = Policy(allow_anonymous=True, max_body_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        response = await post(fastapi_app(store, policy, route=5000), store, 2000)
    assert_our_413(response, 1000)
    assert "POST /p accepts request bodies up to 5000 bytes" in caplog.text
    assert "raise max_body_bytes to 5000" in caplog.text


async def test_a_mounts_limit_caps_the_routes_under_it() -> None:
    store = MemoryStore()
    response = await post(starlette_app(store, mount=50), store, 60, "/m/p")
    assert_our_413(response, 50)
    assert await records(store) == []


async def test_a_route_under_a_mount_raises_the_mounts_limit_as_in_the_bare_app() -> None:
    """With no app-level limit, Starlette's first limiter counts what the app reads, under the
    innermost limit: the route's, as in the bare app."""
    store = MemoryStore()
    response = await post(starlette_app(store, mount=50, route=2000), store, 60, "/m/p")
    assert response.status_code == 201


async def test_under_an_app_limit_a_mounts_lower_limit_stands_before_the_claim() -> None:
    """An app-level limiter has counted the body the middleware read: the mount's limiter then
    refuses it whatever the route's says (the bare app checks before reading); so before any
    claim."""
    store = MemoryStore()
    app = starlette_app(store, app=1000, mount=50, route=2000)
    response = await post(app, store, 60, "/m/p")
    assert_our_413(response, 50)
    assert await records(store) == []


async def test_a_fastapi_route_above_its_apps_limit_is_refused_before_the_claim_and_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FastAPI's app limit is also its router's, which checks the body the middleware has read
    before the route can raise it: refused for its size before any claim, and said at startup."""
    store = MemoryStore()
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        response = await post(fastapi_app(store, app=100, route=2000), store, 500)
    assert response.status_code == 413
    assert await records(store) == []
    assert "the app's max_body_size=100 refuses them" in caplog.text


def test_a_declared_limit_is_worked_out_once_per_object_and_never_for_another() -> None:
    """`declared_limit` keeps its answer with the object it was worked out for: an id that a
    new object reuses (the first one gone) is worked out again, and the memo is bounded."""

    async def create(request: Request) -> JSONResponse:
        return JSONResponse({})

    route = Route("/p", create, methods=["POST"], max_body_size=7)
    memo: body_limits.LimitMemo = {}
    assert body_limits.declared_limit(route, memo) == 7
    assert memo[id(route)] == (route, 7)
    # Another object under the route's id (as when an object is gone and its id reused).
    memo[id(route)] = (object(), 123)
    assert body_limits.declared_limit(route, memo) == 7
    for _ in range(body_limits._MEMO_SIZE + 5):
        body_limits.declared_limit(Route("/x", create), memo)
    assert len(memo) <= body_limits._MEMO_SIZE
