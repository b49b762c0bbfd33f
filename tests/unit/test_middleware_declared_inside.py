"""Middleware declared on the way to a guarded route (a Route's, Mount's or Router's
`middleware=[...]`, a mounted app's own list) runs inside the idempotency middleware, whatever
the app's own list says: startup reads it there too.

Found by probing: Starlette's AuthenticationMiddleware declared on a route, a mount, a router
or a mounted app (with the default tenant resolver and none in the app's list) only drew the
warning that no authentication ran before the middleware, "unless another middleware sets
scope['user']", and every guarded request of those routes was then refused (500). It is the
same mistake as one after ours in the app's list, which fails the startup: now so does this.
A CORSMiddleware or GZipMiddleware declared there was not warned of at all."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Host, Mount, Route, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, not_idempotent
from tests.apps.clients import BearerBackend

pytestmark = pytest.mark.asyncio

AUTH = Middleware(AuthenticationMiddleware, backend=BearerBackend())


async def pay(request: Request) -> Response:
    await request.body()
    return JSONResponse({"paid": True}, status_code=201)


def _declared(where: str) -> list[BaseRoute]:
    """A guarded `POST .../pay` with the authentication declared `where`."""
    if where == "route":
        return [Route("/pay", pay, methods=["POST"], middleware=[AUTH])]
    inner = [Route("/pay", pay, methods=["POST"])]
    if where == "mount":
        return [Mount("/api", routes=inner, middleware=[AUTH])]
    if where == "router":
        return [Mount("/api", app=Router(inner, middleware=[AUTH]))]
    if where == "mounted app":
        return [Mount("/api", app=Starlette(routes=inner, middleware=[AUTH]))]
    assert where == "host"
    return [Host("api.example", app=Router([Mount("/v1", routes=inner, middleware=[AUTH])]))]


async def _lifespan(app: ASGIApp) -> list[Message]:
    """What the app sends for a lifespan startup (an exception it raised then, swallowed)."""
    sent: list[Message] = []
    incoming = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive() -> Message:
        return next(incoming)

    async def send(message: Message) -> None:
        sent.append(message)

    with contextlib.suppress(Exception):  # (Starlette re-raises what failed the startup)
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    return sent


@pytest.mark.parametrize("where", ["route", "mount", "router", "mounted app", "host"])
@pytest.mark.parametrize("anonymous", [False, True])
async def test_authentication_declared_on_the_way_to_a_guarded_route_fails_the_startup(
    where: str, anonymous: bool
) -> None:
    app = Starlette(routes=_declared(where))
    policy = Policy(allow_anonymous=anonymous)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=policy)
    sent = await _lifespan(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    declared = {"route": "/pay", "host": "api.example/v1"}.get(where, "/api")
    assert f"AuthenticationMiddleware is declared on {declared} (" in sent[0]["message"]


@pytest.mark.parametrize("where", ["route", "mount", "router", "mounted app"])
async def test_authentication_both_before_ours_and_declared_inside_fails_the_startup(
    where: str,
) -> None:
    """The one inside names the caller again after the tenant was resolved: with another
    backend (a session outside, an API key inside) the handler served one caller and the
    record was kept under another, whose retries were replayed the first one's response.
    (Found by probing; it was taken for harmless, as if the inner one changed nothing.)"""
    app = Starlette(routes=_declared(where))
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    sent = await _lifespan(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    declared = "/pay" if where == "route" else "/api"
    assert (
        f"runs both before IdempotencyMiddleware and inside it (on {declared})"
        in (sent[0]["message"])
    )


async def test_authentication_declared_on_routes_that_are_not_guarded_is_not_an_error() -> None:
    """An admin mount with its own authentication, beside guarded routes open to anyone."""

    @not_idempotent
    async def admin(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    app = Starlette(
        routes=[
            Route("/pay", pay, methods=["POST"]),
            Route("/one", admin, methods=["POST"], middleware=[AUTH]),
            Mount("/admin", routes=[Route("/x", admin, methods=["POST"])], middleware=[AUTH]),
        ]
    )
    policy = Policy(allow_anonymous=True)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=policy)
    sent = await _lifespan(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_cors_declared_on_a_mount_of_guarded_routes_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cors: Any = Middleware(CORSMiddleware, allow_origins=["https://a.example"])
    app = Starlette(
        routes=[Mount("/api", routes=[Route("/pay", pay, methods=["POST"])], middleware=[cors])]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t")
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        sent = await _lifespan(app)
    assert sent[0]["type"] == "lifespan.startup.complete"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert warned[0].startswith("idempotency: CORSMiddleware is declared on /api, so it runs")


async def test_authentication_in_an_app_mounted_by_an_included_fastapi_router_fails() -> None:
    fastapi = pytest.importorskip("fastapi")
    from idem_middleware.fastapi import install

    router = fastapi.APIRouter()
    inner = [Route("/pay", pay, methods=["POST"])]
    router.mount("/sub", Starlette(routes=inner, middleware=[AUTH]))
    app = fastapi.FastAPI()
    app.include_router(router, prefix="/v1")
    install(app, store=MemoryStore(), www_authenticate="Bearer")
    sent = await _lifespan(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "AuthenticationMiddleware is declared on /v1/sub" in sent[0]["message"]


def _closure(app: ASGIApp) -> ASGIApp:
    """A middleware written as a function: what it wraps is in its closure."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        await app(scope, receive, send)

    return wrapped


class _Private:
    """A middleware that keeps what it wraps under another name than `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self._inner = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._inner(scope, receive, send)


@pytest.mark.parametrize("hiding", [_closure, _Private])
async def test_a_mounts_middleware_that_hides_what_it_wraps_leaves_its_routes_guarded(
    hiding: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: the routes under `Mount(..., middleware=[...])` were looked for through
    the middleware's `app`; one without it (a function's closure, a private attribute) hid the
    mount's routes, and their requests ran unguarded (startup: "its routes cannot be seen"),
    the handler again for every retry. The Mount keeps the app it was given below its list."""
    ran = 0

    async def counted(request: Request) -> Response:
        nonlocal ran
        ran += 1
        return await pay(request)

    inner = [Route("/pay", counted, methods=["POST"])]
    app = Starlette(routes=[Mount("/api", routes=inner, middleware=[Middleware(hiding)])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t")
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            first = await client.post("/api/pay", headers={"idempotency-key": "k"}, content=b"{}")
            again = await client.post("/api/pay", headers={"idempotency-key": "k"}, content=b"{}")
            missing = await client.post("/api/pay", content=b"{}")
    assert (first.status_code, again.headers.get("idempotent-replayed"), ran) == (201, "true", 1)
    assert missing.status_code == 400  # the key is required there as anywhere
    logged = [r.getMessage() for r in caplog.records]
    assert "idempotency: guarding POST /api/pay (transactional, key required, wait 5s)" in logged


async def test_authentication_in_a_router_below_a_hiding_mount_middleware_fails() -> None:
    router = Router([Route("/pay", pay, methods=["POST"])], middleware=[AUTH])
    app = Starlette(routes=[Mount("/api", app=router, middleware=[Middleware(_Private)])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    sent = await _lifespan(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "AuthenticationMiddleware is declared on /api (" in sent[0]["message"]


async def test_a_fastapi_app_mounted_with_a_hiding_middleware_documents_the_key() -> None:
    """Its own /openapi.json says the parent's middleware requires the key, as without it."""
    fastapi = pytest.importorskip("fastapi")
    from idem_middleware.fastapi import install

    app = fastapi.FastAPI()
    install(app, store=MemoryStore(), tenant_resolver=lambda s: "t")
    sub = fastapi.FastAPI()

    @sub.post("/orders")
    async def order() -> dict[str, str]:
        return {}

    app.mount("/v1", sub)
    app.router.routes[-1] = Mount("/v1", app=sub, middleware=[Middleware(_Private)])
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        refused = await client.post("/v1/orders")
        spec = (await client.get("/v1/openapi.json")).json()
    assert refused.status_code == 400
    parameters = spec["paths"]["/orders"]["post"].get("parameters", [])
    assert any(p["name"].lower() == "idempotency-key" for p in parameters), parameters


async def _first_request(app: ASGIApp, path: str, host: str = "api.example.com") -> Any:
    """The first request's answer, or the exception it raised (its check's)."""
    transport = httpx.ASGITransport(app=app)
    headers = {"idempotency-key": "k", "authorization": "Bearer demo-a"}
    async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as client:
        try:
            return await client.post(path, headers=headers, content=b"{}")
        except Exception as exc:  # (the failed check, raised for the server to log)
            return exc


def _ok() -> Any:
    """A fresh endpoint (one `@idempotent` wrapped is marked: see endpoints.WRAPPER_ATTRIBUTE)."""

    async def ok(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    return ok


async def test_a_host_route_of_a_mounted_sub_app_with_its_own_middleware_is_checked() -> None:
    """Found by fuzzing: a sub-app with its own middleware, mounted at `/v1`, with a route
    under `Host("api.example.com")` beside one outside it. Its first request's check names the
    routes as the router above lists them; `api.example.com/v1/money` was not taken for the
    app's own `api.example.com/money`, so the Host route was left out of every check: two
    routes of one name in different modes (refused alone) passed, and the one's key replayed
    the other's response."""
    from idem_middleware import ConfigurationError, idempotent

    charge = idempotent(operation="POST /money")(_ok())
    refund = idempotent(operation="POST /money", mode="lease")(_ok())
    hosted = Host("api.example.com", app=Router([Route("/refund", refund, methods=["POST"])]))
    sub = Starlette(
        routes=[Route("/charge", charge, methods=["POST"]), hosted],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )
    app = Starlette(
        routes=[Mount("/v1", app=sub)],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )
    failed = await _first_request(app, "/v1/charge")
    assert isinstance(failed, ConfigurationError), failed
    assert "guarded routes named POST /money differ in mode" in str(failed)


def _accepting_app(store: MemoryStore) -> Starlette:
    """`POST /pay` answered 202 + Location while in flight, by a middleware of its own."""
    accepting = Policy(accept_while_in_flight=True)
    return Starlette(
        routes=[Route("/pay", _ok(), methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store, default_policy=accepting)],
    )


async def test_a_default_apps_status_location_served_by_the_router_above_passes() -> None:
    """Found by fuzzing: a router's default app with its own middleware and an
    `accept_while_in_flight` route, the status resource in the router above. The Location
    (the request's own root path) is served there, but the default app's check, at its first
    request, looked in its own routes only: every request to it was a 500."""
    from idem_middleware.status import status_route

    store = MemoryStore()
    legacy = _accepting_app(store)
    app = Starlette(
        routes=[status_route(store)],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )
    app.router.default = legacy
    answer = await _first_request(app, "/pay")
    assert not isinstance(answer, Exception), answer
    assert answer.status_code == 201, answer.text


async def test_a_sub_app_mounted_twice_is_checked_for_every_mounts_location() -> None:
    """Found in review: with the status resource served above at `/a/idempotency/status` only,
    a sub-app mounted at `/a` and `/b` passed its check when its first request came through
    `/a`, and a duplicate through `/b` got a Location that was a 404. The router above resolves
    the Location for the app only where it lists the app at its own paths (a default app)."""
    from idem_middleware import ConfigurationError
    from idem_middleware.status import status_route

    store = MemoryStore()
    sub = _accepting_app(store)
    app = Starlette(
        routes=[
            status_route(store, path="/a/idempotency/status"),
            Mount("/a", app=sub),
            Mount("/b", app=sub),
        ],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )
    failed = await _first_request(app, "/a/pay")
    assert isinstance(failed, ConfigurationError), failed
    assert "no route of the app serves GET /idempotency/status" in str(failed)


@pytest.mark.parametrize("as_default", [False, True])
async def test_an_inner_middlewares_status_path_is_not_asked_when_an_outer_one_guards(
    as_default: bool,
) -> None:
    """Found by fuzzing: a sub-app with its own middleware and an `accept_while_in_flight`
    route, under an app whose middleware serves its own status resource. The outer one guards
    the sub-app's requests and answers their duplicates with its own Location, but the inner
    one's check, at the first request reaching it, asked for its own status path and failed:
    every request to the sub-app was a 500."""
    from idem_middleware import idempotent
    from idem_middleware.status import status_route

    store = MemoryStore()
    accepting = idempotent(accept_while_in_flight=True)(_ok())  # (its own: both read it)
    inner = Starlette(
        routes=[Route("/pay", accepting, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
    )
    mounted = Mount("/items", app=Router(routes=[], default=inner) if as_default else inner)
    app = Starlette(
        routes=[status_route(store, path="/v1/status"), mounted],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, status_path="/v1/status"),
        ],
    )
    answer = await _first_request(app, "/items/pay")
    assert not isinstance(answer, Exception), answer
    assert answer.status_code == 201, answer.text
