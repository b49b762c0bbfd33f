"""The middleware caches resolved routes by path, from a path's second request on: path
parameters, hosts and mounted apps stay exact, and the cache and what it remembers of paths met
once stay bounded however many distinct paths arrive."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, get_context, route_cache
from idem_middleware.route_cache import ROUTE_CACHE_SIZE as _ROUTE_CACHE_SIZE
from tests.apps import BearerBackend, client, idempotency_middleware, key


async def credit(request: Request) -> Response:
    ctx = get_context(request)
    return JSONResponse(
        {"account": request.path_params["account_id"], "operation": ctx.operation},
        status_code=201,
    )


def _app() -> Starlette:
    return Starlette(
        routes=[
            Route("/accounts/{account_id}/credits", credit, methods=["POST"]),
            Route("/accounts/{account_id}/credits", credit, methods=["PUT"]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )


async def test_each_path_keeps_its_own_parameters_and_the_cache_stays_bounded() -> None:
    app = _app()
    n = _ROUTE_CACHE_SIZE + 50
    async with client(app) as c:
        for i in range(n):
            for sent in range(2):  # (a path is kept from its second request on)
                path = f"/accounts/a{i}/credits"
                r = await c.post(path, json={"amount": 1}, headers=key(f"k{i}"))
                assert r.status_code == 201, r.text
                assert r.json() == {
                    "account": f"a{i}",
                    "operation": "POST /accounts/{account_id}/credits",
                }
                assert ("idempotent-replayed" in r.headers) is (sent == 1)
            if i == 0:
                assert [k[3] for k in idempotency_middleware(app)._routes] == [path]
        # A path seen before (perhaps cleared since) and a new one: both exact.
        again = await c.post("/accounts/a3/credits", json={"amount": 1}, headers=key("x3"))
        assert again.json()["account"] == "a3"
        # PUT is not guarded by default: the same path, another method, another answer.
        put = await c.put("/accounts/a3/credits", json={"amount": 1})
        assert put.status_code == 500  # no claim, so get_context raises in the handler
    assert len(idempotency_middleware(app)._routes) <= _ROUTE_CACHE_SIZE


async def test_long_paths_and_hosts_are_resolved_but_not_kept() -> None:
    """A server takes paths of 64 KB (uvicorn with httptools), and any client could send them:
    kept, 1,024 such paths (each answered 400 for want of a key) held 130 MB of the worker until
    the cache was next cleared. They are resolved each time instead, and guarded as before."""
    app = _app()
    account = "a" * 2000
    async with client(app) as c:
        for i in range(3):
            path = f"/accounts/{account}{i}/credits"
            assert (await c.post(path, json={"amount": 1})).status_code == 400  # no key
            first = await c.post(path, json={"amount": 1}, headers=key(f"k{i}"))
            assert first.status_code == 201, first.text
            assert first.json()["account"] == f"{account}{i}"
            again = await c.post(path, json={"amount": 1}, headers=key(f"k{i}"))
            assert again.headers["idempotent-replayed"] == "true"
        long_host = {"host": "h" * 2000, **key("host")}
        assert (await c.post("/accounts/a/credits", json={}, headers=long_host)).status_code == 201
        for name in ("short", "short-2"):  # (a path is kept from its second request on)
            short = await c.post("/accounts/a/credits", json={}, headers=key(name))
            assert short.status_code == 201
        # (Any token is a method to a server: one of 2,000 characters, found by probing, was
        # kept too. It is answered as any method the route does not take.)
        long_method = await c.request("M" * 2000, "/accounts/a/credits", headers=key("m"))
        assert long_method.status_code == 405
    kept = idempotency_middleware(app)._routes
    assert [k[3] for k in kept] == ["/accounts/a/credits"]
    assert [k[1] for k in kept] == ["POST"]


async def test_a_key_sent_again_on_another_path_of_the_route_is_another_request() -> None:
    """Each cached path has its own fingerprinter, its path's parameters in it: the same key
    and body on another account is refused as a reused key, and the first path still replays."""
    app = _app()
    async with client(app) as c:
        first = await c.post("/accounts/a1/credits", json={"amount": 1}, headers=key("same"))
        assert first.status_code == 201, first.text
        other = await c.post("/accounts/a2/credits", json={"amount": 1}, headers=key("same"))
        assert other.status_code == 422, other.text
        assert other.json()["type"].endswith("key-reused"), other.text
        again = await c.post("/accounts/a1/credits", json={"amount": 1}, headers=key("same"))
        assert again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()


async def test_a_path_met_once_is_resolved_and_not_kept() -> None:
    """Most paths with an id in them are met once: keeping each one's resolution cost more than
    finding it. The first request to a path is resolved and answered, and nothing is kept; the
    second keeps it; a path met once whose key another request reuses is still exact."""
    app = _app()
    async with client(app) as c:
        first = await c.post("/accounts/once/credits", json={"amount": 1}, headers=key("a"))
        assert first.status_code == 201, first.text
        middleware = idempotency_middleware(app)
        assert first.json()["account"] == "once"
        assert middleware._routes == {}
        other = await c.post("/accounts/other/credits", json={"amount": 1}, headers=key("a"))
        assert other.status_code == 422, other.text  # another path's request, the same key
        assert middleware._routes == {}
        again = await c.post("/accounts/once/credits", json={"amount": 1}, headers=key("a"))
        assert again.headers["idempotent-replayed"] == "true"
        assert [k[3] for k in middleware._routes] == ["/accounts/once/credits"]


async def test_the_paths_met_once_are_remembered_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the middleware remembers of the paths met once (a hash each) is cleared when full: a
    path met again after that is resolved afresh, and kept at its next request."""
    monkeypatch.setattr(route_cache, "SEEN_SIZE", 8)
    app = _app()
    async with client(app) as c:
        for i in range(20):
            r = await c.post(f"/accounts/s{i}/credits", json={"amount": 1}, headers=key(f"s{i}"))
            assert r.status_code == 201, r.text
            assert r.json()["account"] == f"s{i}"
            middleware = idempotency_middleware(app)
            assert len(middleware._seen._hashes) == i % 8 + 1
        assert middleware._routes == {}
        # s0 was forgotten when the set was cleared: met "once" again, then kept.
        for sent in range(2):
            r = await c.post("/accounts/s0/credits", json={"amount": 1}, headers=key("s0"))
            assert r.headers["idempotent-replayed"] == "true"
            assert len(middleware._routes) == sent
