"""An `@idempotent` endpoint the middleware does not find where it looks.

A decorated endpoint runs only under a claim, or when the middleware passed its request on by
decision (a safe method, the middleware switched off, no key where none is required). Reached
through a route whose endpoint is another object (a `functools.partial`, an `HTTPEndpoint`
class), its policy is found through it; reached where the middleware cannot see (an app mounted
behind a wrapper, a router's default app), it refuses to run rather than run unguarded.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, ClassVar

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Host, Mount, Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware import ConfigurationError, IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.endpoints import endpoint_policy, idempotent, not_idempotent
from idem_middleware.ops import collect_policies
from idem_middleware.store import RecordKey
from tests.apps import assert_problem, assert_replay_of, client, key
from tests.apps.clients import BearerBackend


def _guarded(routes: list[Any], **options: Any) -> Starlette:
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, **{"store": MemoryStore(), **options}),
        ],
    )


@idempotent(wait_seconds=1)
async def put_order(request: Request, ledger: list[str]) -> JSONResponse:
    ledger.append(request.method)
    return JSONResponse({"runs": len(ledger)}, status_code=201)


async def test_an_endpoint_given_as_a_partial_is_guarded_by_its_own_policy() -> None:
    """PUT is not among the methods guarded by default: only the decorator's policy guards it."""
    runs: list[str] = []
    endpoint = functools.partial(functools.partial(put_order), ledger=runs)
    app = _guarded([Route("/orders", endpoint, methods=["PUT"])])
    async with client(app) as c:
        first = await c.put("/orders", json={"a": 1}, headers=key("k1"))
        again = await c.put("/orders", json={"a": 1}, headers=key("k1"))
        keyless = await c.put("/orders", json={"a": 1})
    assert first.status_code == 201
    assert_replay_of(again, first)
    assert_problem(keyless, 400, "missing-key")
    assert runs == ["PUT"]


async def test_a_fastapi_route_given_a_partial_is_guarded_by_its_own_policy() -> None:
    runs: list[str] = []

    @idempotent()
    async def refund(amount: int, tag: str) -> dict[str, int]:
        runs.append(tag)
        return {"runs": len(runs)}

    api = FastAPI()
    api.add_api_route("/refunds", functools.partial(refund, tag="refund"), methods=["PUT"])
    api.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    api.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    async with client(api) as c:  # type: ignore[arg-type]
        first = await c.put("/refunds?amount=5", headers=key("k1"))
        again = await c.put("/refunds?amount=5", headers=key("k1"))
    assert first.status_code == 200
    assert_replay_of(again, first)
    assert runs == ["refund"]


class Orders(HTTPEndpoint):
    runs: ClassVar[list[str]] = []

    @idempotent(wait_seconds=1)
    async def put(self, request: Request) -> JSONResponse:
        self.runs.append("put")
        return JSONResponse({"runs": len(self.runs)}, status_code=201)

    @idempotent(key_required=False)
    async def post(self, request: Request) -> JSONResponse:
        self.runs.append("post")
        return JSONResponse({"runs": len(self.runs)}, status_code=201)


async def test_the_methods_of_an_http_endpoint_are_guarded_by_their_own_policies() -> None:
    Orders.runs = []
    app = _guarded([Route("/orders/{id}", Orders)])
    async with client(app) as c:
        first = await c.put("/orders/1", json={"a": 1}, headers=key("k1"))
        again = await c.put("/orders/1", json={"a": 1}, headers=key("k1"))
        keyless = await c.post("/orders/1", json={"a": 1})  # post's policy: key optional
        keyed = await c.post("/orders/1", json={"a": 1}, headers=key("k2"))
        keyed_again = await c.post("/orders/1", json={"a": 1}, headers=key("k2"))
    assert first.status_code == 201
    assert_replay_of(again, first)
    assert keyless.status_code == 201
    assert_replay_of(keyed_again, keyed)
    assert Orders.runs == ["put", "post", "post"]


def test_an_endpoints_policy_is_found_through_partials_and_on_its_class_first() -> None:
    policy = Policy(wait_seconds=2)

    @idempotent(policy)
    async def handler(request: Request) -> None: ...

    assert endpoint_policy(functools.partial(functools.partial(handler), x=1)) is policy
    assert endpoint_policy(Orders, "PUT") is endpoint_policy(Orders.put)
    assert endpoint_policy(Orders, "DELETE") is None
    assert endpoint_policy(Orders) is None  # (no method: the class's own policy only)
    exempt = not_idempotent(type("Exempt", (Orders,), {}))
    own = endpoint_policy(exempt, "PUT")
    assert own is not None
    assert not own.guard  # the class's own policy comes first


class _Wrapper:
    """ASGI middleware that keeps what it wraps to itself: the middleware cannot see past it."""

    def __init__(self, inner: ASGIApp) -> None:
        self._inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._inner(scope, receive, send)


def _refund_app() -> tuple[Starlette, list[int]]:
    runs: list[int] = []

    @idempotent()
    async def refund(request: Request) -> JSONResponse:
        runs.append(1)
        return JSONResponse({"runs": len(runs)}, status_code=201)

    return Starlette(routes=[Route("/refund", refund, methods=["POST"])]), runs


def _raising_client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://test",
        headers={"authorization": "Bearer demo-a"},
    )


@pytest.mark.parametrize("where", ["behind a wrapper", "the router's default"])
async def test_a_decorated_endpoint_the_middleware_cannot_see_refuses_to_run(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="idem_middleware")
    sub, runs = _refund_app()
    if where == "behind a wrapper":
        app = _guarded([Mount("/v2", app=_Wrapper(sub))])
        path = "/v2/refund"
    else:
        app = _guarded([Route("/new", lambda request: JSONResponse({}), methods=["POST"])])
        app.router.default = _Wrapper(sub)
        path = "/refund"
    async with client(app) as c:
        refused = [await c.post(path, json={"a": 1}, headers=key("k1")) for _ in range(2)]
    assert [r.status_code for r in refused] == [500, 500]
    assert runs == []
    hidden = (
        "/v2 (a mounted _Wrapper)" if where == "behind a wrapper" else "the router's default app"
    )
    assert f"{hidden}: its routes cannot be seen; its requests are not guarded" in caplog.text
    async with _raising_client(app) as c:
        with pytest.raises(ConfigurationError, match="passed this request on did not find it"):
            await c.post(path, json={"a": 1}, headers=key("k1"))
    assert runs == []


@pytest.mark.parametrize("decorated", [True, False])
async def test_the_routes_of_a_routers_default_app_are_guarded_as_requests_reach_them(
    decorated: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: `Router(routes, default=legacy_app)`, where a request no route matches
    goes. The middleware looked in the router's routes only: the legacy app's `POST /refund` ran
    with no key, and again for each repeat of one (a decorated one was refused its every
    request). Its routes are found as the router's own now, and listed at startup."""
    caplog.set_level(logging.INFO, logger="idem_middleware")
    legacy, runs = _refund_app()
    if not decorated:  # (guarded by the middleware's default policy for POST)

        async def refund(request: Request) -> JSONResponse:
            runs.append(1)
            return JSONResponse({"runs": len(runs)}, status_code=201)

        legacy = Starlette(routes=[Route("/refund", refund, methods=["POST"])])
    app = _guarded([Route("/new", lambda request: JSONResponse({}), methods=["POST"])])
    app.router.default = legacy
    async with client(app) as c:
        unkeyed = await c.post("/refund", json={"a": 1})
        placed = await c.post("/refund", json={"a": 1}, headers=key("k1"))
        again = await c.post("/refund", json={"a": 1}, headers=key("k1"))
    assert_problem(unkeyed, 400, "missing-key")
    assert_replay_of(again, placed)
    assert runs == [1]
    assert "guarding POST /refund" in caplog.text
    assert "POST /refund" in collect_policies(app)  # (what the CLI and OpenAPI read)


async def test_a_default_app_that_leads_back_up_is_listed_once_and_served() -> None:
    """Found in review: `sub.default = app.router` under `Mount("/api", app=sub)` (an unmatched
    `/api/...` goes back to the app's own routes) sent the startup check and the CLI's listing
    round the loop until Python's recursion limit: every request a 500."""
    runs: list[str] = []

    async def paid(request: Request) -> JSONResponse:
        runs.append(request.url.path)
        return JSONResponse({}, status_code=201)

    sub = Router([Route("/refund", paid, methods=["POST"])])
    app = _guarded([Mount("/api", app=sub), Route("/pay", paid, methods=["POST"])])
    sub.default = app.router
    async with client(app) as c:
        placed = await c.post("/api/pay", json={}, headers=key("k"))
        again = await c.post("/api/pay", json={}, headers=key("k"))
    assert_replay_of(again, placed)
    assert runs == ["/api/pay"]
    assert {"POST /api/pay", "POST /pay", "POST /api/refund"} <= set(collect_policies(app))


@pytest.mark.parametrize("own", ["GET /refund", "POST /refund/"])
async def test_a_request_the_router_answers_itself_is_not_taken_for_its_default_apps(
    own: str,
) -> None:
    """The router hands a request to its default app only when no route takes it in part (a
    405 for another method) and its path with a slash added or taken away matches none (a
    redirect): the default's `POST /refund` guards neither."""
    legacy, runs = _refund_app()
    method, path = own.split(" ")
    app = _guarded([Route(path, lambda request: JSONResponse({}), methods=[method])])
    app.router.default = legacy
    async with client(app) as c:
        answer = await c.post("/refund", json={"a": 1})  # (no key: guarded, it was a 400)
    assert answer.status_code == (405 if method == "GET" else 307), answer.text
    assert runs == []


async def test_a_default_app_is_checked_and_listed_as_a_mounted_app_is() -> None:
    """Found in review: a default app's own authentication (inside the middleware: every guarded
    request a 500) and its own middleware's policies passed the startup check, which a Mount of
    the same app fails; and a default below a Mount, or a default's own default, was guarded
    but not listed (the CLI's reconcilers and `policies` keys could not name it)."""
    legacy, _ = _refund_app()
    legacy.user_middleware.insert(0, Middleware(AuthenticationMiddleware, backend=BearerBackend()))
    app = Starlette(  # (no authentication outside: the default app's own comes too late)
        routes=[Route("/new", lambda request: JSONResponse({}), methods=["GET"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )
    app.router.default = legacy
    async with _raising_client(app) as c:
        with pytest.raises(ConfigurationError, match="AuthenticationMiddleware is declared on /"):
            await c.post("/refund", json={"a": 1}, headers=key("k1"))
    below, _ = _refund_app()
    chained, _ = _refund_app()
    chained.router.routes[0].path = "/old"  # type: ignore[attr-defined]
    chained.router.routes[0].path_regex = re.compile("^/old$")  # type: ignore[attr-defined]
    below.router.default = chained
    nested = Router([Route("/new", lambda request: JSONResponse({}), methods=["POST"])])
    nested.default = below
    app = _guarded([Mount("/api", app=nested)])
    assert {"POST /api/refund", "POST /api/old"} <= set(collect_policies(app))


async def test_a_decorated_endpoint_still_runs_for_a_safe_method_the_middleware_passes_on() -> None:
    runs: list[str] = []

    @idempotent()
    async def orders(request: Request) -> JSONResponse:
        runs.append(request.method)
        return JSONResponse({"runs": len(runs)}, status_code=201)

    app = _guarded([Route("/orders", orders, methods=["GET", "POST"])])
    async with client(app) as c:
        listed = await c.get("/orders")
        placed = await c.post("/orders", json={"a": 1}, headers=key("k1"))
        again = await c.post("/orders", json={"a": 1}, headers=key("k1"))
    assert listed.status_code == 201
    assert_replay_of(again, placed)
    assert runs == ["GET", "POST"]


class MethodOverride:
    """`X-HTTP-Method-Override`, as such middleware does it: here inside the idempotency one
    (the misconfiguration the startup check warns of)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope.get("headers", ()):
            if name == b"x-http-method-override":
                scope = {**scope, "method": value.decode().upper()}
        await self.app(scope, receive, send)


@pytest.mark.parametrize("method", ["GET", "OPTIONS", "PUT"])
async def test_a_safe_method_made_another_inside_the_middleware_does_not_run_a_decorated_endpoint(
    method: str,
) -> None:
    """Found by probing: a PUT made a POST inside was refused, but a GET or OPTIONS made a POST
    ran the `@idempotent` POST endpoint unguarded, once for each repeat of one key: a safe
    method's pass-through was `Handled.YES`, which decorated endpoints took for handled."""
    runs: list[str] = []

    @idempotent()
    async def pay(request: Request) -> JSONResponse:
        runs.append(request.method)
        return JSONResponse({"runs": len(runs)}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
            Middleware(MethodOverride),
        ],
    )
    overridden = {"x-http-method-override": "POST", **key("k")}
    async with client(app) as c:
        answers = [await c.request(method, "/pay", json={}, headers=overridden) for _ in range(2)]
    assert [answer.status_code for answer in answers] == [500, 500]
    told = "did not find it" if method == "PUT" else "a middleware inside it changed the method"
    async with _raising_client(app) as c:
        with pytest.raises(ConfigurationError, match=told):
            await c.request(method, "/pay", json={}, headers=overridden)
    assert runs == []


class InPlaceOverride(MethodOverride):
    """The same, changing the scope it was given."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope.get("headers", ()):
            if name == b"x-http-method-override":
                scope["method"] = value.decode().upper()
        await self.app(scope, receive, send)


async def test_a_fastapi_endpoint_without_a_request_is_refused_a_get_made_a_post_in_place() -> None:
    """Without a `Request` among its arguments, the method it is reached by is read from the
    scope the middleware passed on."""
    runs: list[str] = []
    app = FastAPI()

    @app.post("/pay")
    @idempotent()
    async def pay() -> dict[str, int]:
        runs.append("pay")
        return {"runs": len(runs)}

    app.add_middleware(InPlaceOverride)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    overridden = {"x-http-method-override": "POST", **key("k")}
    async with client(app) as c:
        answers = [await c.get("/pay", headers=overridden) for _ in range(2)]
    assert [answer.status_code for answer in answers] == [500, 500]
    assert runs == []


async def test_a_decorated_endpoint_a_route_serves_with_get_runs_it_however_it_was_routed() -> None:
    """A first version of the check above marked, at startup, the decorated endpoints a route
    served with a safe method, and refused the others' GET: an endpoint behind a decorator of
    the app's own, a route added at run time and one added in the app's lifespan were refused
    their GET (500), which they had always answered."""
    runs: list[str] = []

    def logged(endpoint: Any) -> Any:
        @functools.wraps(endpoint)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return await endpoint(*args, **kwargs)

        return wrapper

    app = FastAPI()

    @app.api_route("/pay", methods=["GET", "POST"])
    @logged
    @idempotent()
    async def pay() -> dict[str, int]:
        runs.append("pay")
        return {"runs": len(runs)}

    @idempotent()
    async def later() -> dict[str, int]:
        runs.append("later")
        return {"runs": len(runs)}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    async with client(app) as c:
        assert (await c.get("/pay")).status_code == 200
        app.add_api_route("/later", later, methods=["GET", "POST"])
        assert (await c.get("/later")).status_code == 200
        placed = await c.post("/later", headers=key("k"))
        again = await c.post("/later", headers=key("k"))
    assert_replay_of(again, placed)
    assert runs == ["pay", "later", "later"]


async def test_a_route_served_as_an_app_is_matched_with_its_own_path() -> None:
    """`Host(..., app=Mount("/v2", ...))`: the Mount matches the request itself (its path
    included); looked through as if it were a router, its `/v2` was lost and nothing matched."""
    runs: list[int] = []

    async def pay(request: Request) -> JSONResponse:
        runs.append(1)
        return JSONResponse({"runs": len(runs)}, status_code=201)

    store = MemoryStore()
    mount = Mount("/v2", routes=[Route("/pay", pay, methods=["POST"])])
    app = _guarded([Host("h.example", mount)], store=store)
    async with client(app) as c:
        first = await c.post("http://h.example/v2/pay", json={"a": 1}, headers=key("k1"))
        again = await c.post("http://h.example/v2/pay", json={"a": 1}, headers=key("k1"))
        keyless = await c.post("http://h.example/v2/pay", json={"a": 1})
    assert first.status_code == 201
    assert_replay_of(again, first)
    assert_problem(keyless, 400, "missing-key")
    assert runs == [1]
    assert await store.get(RecordKey("tenant-a", "POST h.example/v2/pay", "k1")) is not None


async def test_two_guarded_routes_one_operation_names_are_warned_of_at_startup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Routes told apart by more than their path (a version header read by a custom route
    class) share the operation's name, and so one key space."""
    from fastapi import APIRouter
    from fastapi.routing import APIRoute
    from starlette.routing import Match

    def versioned(version: bytes) -> type[APIRoute]:
        class Versioned(APIRoute):
            def matches(self, scope: Scope) -> tuple[Match, Scope]:
                match, child = super().matches(scope)
                if match is Match.FULL and dict(scope["headers"]).get(b"api-version") != version:
                    return Match.NONE, {}
                return match, child

        return Versioned

    api = FastAPI()
    for version in (b"1", b"2"):
        router = APIRouter(route_class=versioned(version))
        router.post("/pay")(lambda: {"ok": 1})
        api.include_router(router)
    api.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    api.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    caplog.set_level(logging.INFO, logger="idem_middleware")
    async with client(api) as c:  # type: ignore[arg-type]
        await c.post("/pay", json={}, headers={**key("k1"), "api-version": "1"})
    assert "POST /pay names more than one guarded route" in caplog.text
    assert caplog.text.count("names more than one guarded route") == 1
