"""What guards a route (its policy, capped by its body limit, and its operation's name) is worked
out once per route, not per path (`route_guard`): new paths of a route keep their own parameters
and fingerprints, a refusal is logged at each request, and what is kept stays bounded."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idem_middleware import (
    IdempotencyMiddleware,
    MemoryStore,
    Policy,
    get_context,
    idempotent,
    not_idempotent,
    route_guard,
)
from idem_middleware.fingerprint import compute_fingerprint
from tests.apps import BearerBackend, assert_problem, client, idempotency_middleware, key


async def credit(request: Request) -> Response:
    ctx = get_context(request)
    return JSONResponse(
        {"account": request.path_params["account_id"], "operation": ctx.operation},
        status_code=201,
    )


class Unhashable:
    """An ASGI app as a route's endpoint (any method) that cannot be a dict's key."""

    def __eq__(self, other: object) -> bool:
        return other is self

    __hash__ = None  # type: ignore[assignment]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse({"id": scope["path_params"]["id"]}, status_code=201)(
            scope, receive, send
        )


def _app(routes: list[Route], **options: object) -> Starlette:
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore(), **options),
        ],
    )


async def test_new_paths_of_a_route_share_its_guard_and_keep_their_parameters() -> None:
    policies = {"POST /accounts/{account_id}/credits": Policy(max_body_bytes=20)}
    app = _app(
        [Route("/accounts/{account_id}/credits", credit, methods=["POST"])], policies=policies
    )
    async with client(app) as c:
        for i in range(5):
            r = await c.post(f"/accounts/n{i}/credits", json={"amount": 1}, headers=key(f"k{i}"))
            assert r.status_code == 201, r.text
            assert r.json() == {
                "account": f"n{i}",
                "operation": "POST /accounts/{account_id}/credits",
            }
            # The policy found once still caps every new path's body.
            big = await c.post(
                f"/accounts/b{i}/credits", json={"memo": "x" * 40}, headers=key(f"b{i}")
            )
            assert big.status_code == 413, big.text
        guards = idempotency_middleware(app)._route_guards
        assert [k[:2] for k in guards] == [("POST", "/accounts/{account_id}/credits")]
        # The same key on another path of the route is another request's: refused, not replayed.
        other = await c.post("/accounts/zz/credits", json={"amount": 1}, headers=key("k0"))
        assert other.status_code == 422, other.text


def test_a_new_paths_fingerprint_is_the_one_compute_fingerprint_gives() -> None:
    """The fingerprinter built per path from the route's kept guard frames the same bytes."""
    mw = IdempotencyMiddleware(
        Starlette(routes=[Route("/a/{x}/b/{y}", credit, methods=["POST"])]), store=MemoryStore()
    )
    for x, y in (("1", "2"), ("é\udc80", "-"), ("long" * 40, "z")):
        scope = {
            "type": "http",
            "method": "POST",
            "path": f"/a/{x}/b/{y}",
            "root_path": "",
            "headers": [],
        }
        guarded = mw._resolve(None, "POST", scope)
        assert guarded is not None
        fingerprinter, _, operation, _ = guarded
        assert operation == "POST /a/{x}/b/{y}"
        expected = compute_fingerprint(
            operation=operation,
            path_params={"x": x, "y": y},
            query_string=b"q=1",
            headers=[],
            include_headers=(),
            content_type=b"application/json",
            body=b'{"a": 1}',
        )
        assert fingerprinter(b"q=1", [], b"application/json", b'{"a": 1}') == expected
    assert len(mw._route_guards) == 1


async def test_an_endpoint_that_cannot_be_hashed_is_guarded_all_the_same() -> None:
    app = _app([Route("/things/{id}", Unhashable())])
    async with client(app) as c:
        for i in range(3):
            r = await c.post(f"/things/t{i}", json={}, headers=key(f"t{i}"))
            assert r.status_code == 201, r.text
            assert r.json() == {"id": f"t{i}"}
            again = await c.post(f"/things/t{i}", json={}, headers=key(f"t{i}"))
            assert again.headers["idempotent-replayed"] == "true"


async def test_a_long_method_is_refused_and_not_kept() -> None:
    """A method (any token) and template longer than a cached path's key: what guards them is
    worked out at each request, never kept (here: an operation no record can hold)."""
    app = _app([Route("/things/{id}", Unhashable())], methods=["POST", "X" * 2000])
    async with client(app) as c:
        for i in range(2):
            r = await c.request("X" * 2000, f"/things/{i}", json={}, headers=key("long"))
            assert r.status_code == 400, r.text
            assert r.json()["type"].endswith("operation-invalid"), r.text
        assert idempotency_middleware(app)._route_guards == {}


async def test_what_guards_routes_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(route_guard, "ROUTE_CACHE_SIZE", 3)
    routes = [Route(f"/r{i}/{{account_id}}", credit, methods=["POST"]) for i in range(10)]
    app = _app(routes)
    async with client(app) as c:
        for i in range(10):
            r = await c.post(f"/r{i}/a", json={}, headers=key(f"r{i}"))
            assert r.status_code == 201, r.text
            assert r.json()["operation"] == f"POST /r{i}/{{account_id}}"
            assert len(idempotency_middleware(app)._route_guards) <= 3


async def test_a_refused_route_is_refused_and_logged_at_each_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A route added after the startup check whose pinned operation names another method: its
    refusal is not kept, and each request is refused and logged."""
    app = _app([Route("/accounts/{account_id}/credits", credit, methods=["POST"])])
    async with client(app) as c:
        assert (await c.post("/accounts/a/credits", json={}, headers=key("a"))).status_code == 201

        @idempotent(operation="POST /payments")
        async def put(request: Request) -> Response:
            raise AssertionError("never run")

        app.router.routes.append(Route("/pay/{pid}", put, methods=["PUT"]))
        for i in range(3):
            with caplog.at_level(logging.ERROR, logger="idem_middleware"):
                caplog.clear()
                refused = await c.put(f"/pay/{i}", json={}, headers=key(f"p{i}"))
            assert_problem(refused, 500, "server-misconfigured")
            assert any("names another method" in r.getMessage() for r in caplog.records)
        assert idempotency_middleware(app)._route_guards.keys() == {
            ("POST", "/accounts/{account_id}/credits", id(credit), None)
        }


async def test_a_route_replaced_by_another_endpoint_is_guarded_by_the_new_ones_policy() -> None:
    """Kept per endpoint: the same template served by another endpoint (the route replaced at
    run time, the old endpoint dropped) finds the new endpoint's policy on its new paths."""
    app = _app([Route("/accounts/{account_id}/credits", credit, methods=["POST"])])
    async with client(app) as c:
        r = await c.post("/accounts/a/credits", json={}, headers=key("a"))
        assert r.json()["operation"] == "POST /accounts/{account_id}/credits"

        @not_idempotent
        async def unguarded(request: Request) -> Response:
            return JSONResponse({"account": request.path_params["account_id"]}, status_code=201)

        app.router.routes[:] = [
            Route("/accounts/{account_id}/credits", unguarded, methods=["POST"])
        ]
        for i in range(2):
            r = await c.post(f"/accounts/u{i}/credits", json={})  # (no key: not guarded)
            assert r.status_code == 201, r.text
            assert r.json() == {"account": f"u{i}"}
