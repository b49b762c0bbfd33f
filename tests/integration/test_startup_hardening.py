"""More configurations that used to fail on every request, or in a way that said nothing, now fail
at startup with a ConfigurationError that names the fix (or work, when they mean one thing):

- a mode given as a string (from a config file) is that mode, in the startup log and on the
  request path;
- the SQLAlchemy `ClaimSession` dependency on a route that is not guarded with a required key
  fails startup, like `Idempotency` and `IdempotencyConnection`;
- `accept_while_in_flight` with no route serving the middleware's `status_path` fails startup
  (the 202's Location would be a 404).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from typing import Annotated, Any

import asyncpg
import pytest
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Host, Mount, Route, Router
from starlette.types import Receive, Scope, Send

from idem_middleware import (
    IdempotencyMiddleware,
    MemoryStore,
    Mode,
    Policy,
    idempotent,
    not_idempotent,
)
from idem_middleware.fastapi import install
from idem_middleware.policy import MAX_SECONDS
from idem_middleware.sqla import ClaimSession, ClaimSessions, claim_session
from idem_middleware.status import status_route
from idem_middleware.store.postgres import PostgresStore
from idem_middleware.tokens import TokenIssuer, token_route
from tests.apps import BearerBackend, assert_replay_of, client, key, records
from tests.integration.test_startup_checks import messages, startup


class Calls:
    def __init__(self) -> None:
        self.n = 0


def started(sent: list[Any]) -> bool:
    return [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def failure(sent: list[Any]) -> str:
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
    message: str = sent[0]["message"]
    return message


def starlette_app(routes: list[BaseRoute], **options: Any) -> Starlette:
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, **options),
        ],
    )


# -- a mode given as a string -------------------------------------------------------------------


async def test_a_mode_given_as_a_string_starts_and_serves_in_that_mode(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Startup used to fail with a bare AttributeError; without a lifespan the transactional
    route ran in lease mode (the request path tests `policy.mode is Mode.TRANSACTIONAL`)."""
    calls = Calls()

    async def pay(request: Request) -> Response:
        await request.body()
        calls.n += 1
        return JSONResponse({"n": calls.n}, status_code=201)

    tx = idempotent(mode="transactional")(pay)  # type: ignore[arg-type]
    lease = idempotent(mode="lease", on_lease_expiry="takeover")(pay)  # type: ignore[arg-type]
    app = starlette_app(
        [Route("/tx", tx, methods=["POST"]), Route("/lease", lease, methods=["POST"])],
        store=pg_store,
    )
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        assert started(await startup(app))
    info = messages(caplog, logging.INFO)
    assert any(m.startswith("idempotency: guarding POST /tx (transactional,") for m in info), info
    assert any(
        m.startswith("idempotency: guarding POST /lease (lease,") and "takeover on expiry" in m
        for m in info
    ), info
    async with client(app) as c:
        for path in ("/tx", "/lease"):
            first = await c.post(path, json={"a": 1}, headers=key("k1"))
            assert first.status_code == 201, first.text
            assert_replay_of(await c.post(path, json={"a": 1}, headers=key("k1")), first)
    assert calls.n == 2
    modes = {r["operation"]: r["mode"] for r in await records(pool)}
    assert modes == {"POST /tx": "transactional", "POST /lease": "lease"}


async def test_the_longest_durations_fit_postgresql(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """The documented bound (100 years) holds in PostgreSQL's interval and timestamp arithmetic:
    retention and lease at the bound claim, settle and replay (1e300 was a 500 on every
    request: interval out of range)."""

    async def pay(request: Request) -> Response:
        await request.body()
        return JSONResponse({}, status_code=201)

    longest = dict(retention_seconds=MAX_SECONDS, wait_seconds=MAX_SECONDS)
    tx = idempotent(**longest)(pay)
    lease = idempotent(mode=Mode.LEASE, lease_seconds=MAX_SECONDS, **longest)(pay)
    app = starlette_app(
        [Route("/tx", tx, methods=["POST"]), Route("/lease", lease, methods=["POST"])],
        store=pg_store,
    )
    async with client(app) as c:
        for path in ("/tx", "/lease"):
            first = await c.post(path, json={}, headers=key("k1"))
            assert first.status_code == 201, first.text
            assert_replay_of(await c.post(path, json={}, headers=key("k1")), first)
    kept = await pool.fetch(
        "SELECT expires_at - now() > interval '99 years' AS far FROM idem_requests"
    )
    assert [r["far"] for r in kept] == [True, True]


# -- ClaimSession on a route that is not guarded ------------------------------------------------


async def order_session(session: ClaimSession) -> Any:
    """An app's own dependency that takes the claim session (found through the chain)."""
    return session


OrderSession = Annotated[Any, Depends(order_session)]
SESSIONS = ClaimSessions()


def session_app(calls: Calls, store: MemoryStore | PostgresStore) -> FastAPI:
    app = FastAPI()

    @app.post("/unguarded")
    @not_idempotent
    async def unguarded(session: ClaimSession) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.post("/optional")
    @idempotent(key_required=False)
    async def optional(session: ClaimSession) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.put("/put")
    async def put(session: ClaimSession) -> dict[str, bool]:  # PUT is not in `methods`
        calls.n += 1
        return {"ok": True}

    @app.post("/own-sessions")
    @not_idempotent
    async def own_sessions(
        session: Annotated[Any, Depends(SESSIONS.dependency)],
    ) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.post("/through")
    @not_idempotent
    async def through(session: OrderSession) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.post("/fine")
    @idempotent()
    async def fine(session: ClaimSession) -> dict[str, bool]:
        return {"ok": True}

    @app.post("/leased")
    @idempotent(mode=Mode.LEASE)
    async def leased(session: Annotated[Any, Depends(claim_session)]) -> dict[str, bool]:
        return {"ok": True}

    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


async def test_a_claim_session_on_a_route_that_is_not_guarded_fails_startup(
    pg_store: PostgresStore,
) -> None:
    message = failure(await startup(session_app(Calls(), pg_store)))
    for expected in (
        "POST /unguarded declares ClaimSession but is not guarded",
        "POST /optional declares ClaimSession but lets a request without a key through",
        "PUT /put declares ClaimSession but is not guarded",
        "POST /own-sessions declares ClaimSession but is not guarded",
        "POST /through declares ClaimSession but is not guarded",
    ):
        assert expected in message, message
    # A claim session works in either mode, with the key required.
    assert "/fine" not in message
    assert "/leased" not in message


async def test_without_lifespan_a_claim_session_misuse_fails_every_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first request runs the check: it is logged, once, naming the route and the fix, and
    every request is refused before any handler runs (the misused routes answered 500 before as
    well, on each request, from inside the dependency, with no word at startup)."""
    calls = Calls()
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        async with client(session_app(calls, MemoryStore())) as c:  # type: ignore[arg-type]
            for _ in range(2):
                assert (await c.post("/unguarded")).status_code == 500
                assert (await c.post("/optional")).status_code == 500
    assert calls.n == 0
    errors = [m for m in messages(caplog, logging.ERROR) if "declares ClaimSession" in m]
    assert len(errors) == 1, errors
    assert "POST /unguarded declares ClaimSession but is not guarded" in errors[0]


async def test_guarded_claim_session_routes_start(pg_store: PostgresStore) -> None:
    app = FastAPI()

    @app.post("/orders")
    async def orders(session: ClaimSession) -> dict[str, bool]:  # POST: guarded by default
        return {"ok": True}

    install(app, store=pg_store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    assert started(await startup(app))


def test_the_check_does_not_import_sqlalchemy() -> None:
    """An app without the `[sqlalchemy]` extra is checked without it: the claim session is
    recognised only once its module was imported (by the app)."""
    program = textwrap.dedent(
        """
        import asyncio, sys
        from fastapi import FastAPI
        from idem_middleware import MemoryStore, not_idempotent
        from idem_middleware.fastapi import Idempotency, install

        app = FastAPI()

        @app.post("/x")
        @not_idempotent
        async def x(idem: Idempotency) -> None: ...

        install(app, store=MemoryStore(), tenant_resolver=lambda scope: "t")
        sent = []

        async def receive():
            return {"type": "lifespan.startup"}

        async def send(message):
            sent.append(message)

        try:
            asyncio.run(app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
        except Exception:
            pass
        assert sent[0]["type"] == "lifespan.startup.failed", sent
        assert "POST /x declares Idempotency but is not guarded" in sent[0]["message"]
        assert "sqlalchemy" not in sys.modules, "the check imported SQLAlchemy"
        assert "idem_middleware.sqla" not in sys.modules
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


# -- accept_while_in_flight needs the status resource -------------------------------------------


async def pay(request: Request) -> Response:
    await request.body()
    return JSONResponse({}, status_code=201)


ACCEPTING = idempotent(accept_while_in_flight=True, wait_seconds=0.1)(pay)


async def test_accept_while_in_flight_without_a_status_route_fails_startup() -> None:
    """The 202's Location was a 404, which a client may take for "unknown request" and send it
    again under a new key."""
    app = starlette_app([Route("/pay", ACCEPTING, methods=["POST"])], store=MemoryStore())
    message = failure(await startup(app))
    assert message == (
        "idem_middleware: accept_while_in_flight=True on POST /pay answers a duplicate in flight "
        "with 202 + Location /idempotency/status?..., but no route of the app serves GET "
        "/idempotency/status: add idem_middleware.status.status_route(store) to the app's routes "
        "(its path must be the middleware's status_path, '/idempotency/status'), or set "
        "status_path to where it is served"
    )


async def test_without_lifespan_a_missing_status_route_fails_every_request() -> None:
    app = starlette_app([Route("/pay", ACCEPTING, methods=["POST"])], store=MemoryStore())
    async with client(app) as c:
        for n in range(2):
            assert (await c.post("/pay", json={}, headers=key(f"k{n}"))).status_code == 500


async def raw_asgi(scope: Scope, receive: Receive, send: Send) -> None:  # pragma: no cover
    await Response(status_code=204)(scope, receive, send)


def status_routes(store: MemoryStore, where: str) -> tuple[list[BaseRoute], dict[str, Any]]:
    """The status resource mounted in one of the ways an app may mount it, and the middleware
    options that go with it."""
    if where == "route":
        return [status_route(store)], {}
    if where == "mount":
        return [Mount("/idempotency", routes=[status_route(store, path="/status")])], {}
    if where == "custom path":
        return [status_route(store, path="/ops/status")], {"status_path": "/ops/status"}
    if where == "host":
        return [Host("api.example", app=Router([status_route(store)]))], {}
    raise AssertionError(where)


@pytest.mark.parametrize("where", ["route", "mount", "custom path", "host"])
async def test_accept_while_in_flight_with_the_status_route_starts(where: str) -> None:
    store = MemoryStore()
    routes, options = status_routes(store, where)
    app = starlette_app(
        [Route("/pay", ACCEPTING, methods=["POST"]), *routes], store=store, **options
    )
    assert started(await startup(app))


async def test_a_status_route_the_host_of_the_operation_never_reaches_fails_startup() -> None:
    """Found by probing: the operation under `Host("api.example")`, the status resource at the
    top level after it. The Host takes every path on its host, so the Location (on the host the
    client used) was a 404; a Host's routes counted whatever the host, and startup passed."""
    store = MemoryStore()
    hosted = Host("api.example", app=Router([Route("/pay", ACCEPTING, methods=["POST"])]))
    app = starlette_app([hosted, status_route(store)], store=store)
    message = failure(await startup(app))
    assert "no route of the app serves GET /idempotency/status on api.example" in message
    served = Host(
        "api.example", app=Router([Route("/pay", ACCEPTING, methods=["POST"]), status_route(store)])
    )
    assert started(await startup(starlette_app([served], store=store)))


@pytest.mark.parametrize(
    "pattern", ["{n:int}.example.com", "{u:uuid}.example.com", "{sub}.example.com"]
)
async def test_a_status_route_under_a_host_pattern_with_parameters_starts(pattern: str) -> None:
    """Found in review: the host was asked as `x.example.com`, which an `int` or `uuid`
    parameter does not take (and a literal Host of that name would): working apps failed their
    startup check."""
    store = MemoryStore()
    admin = Host("x.example.com", app=Router([Route("/other", pay, methods=["GET"])]))
    hosted = Host(
        pattern, app=Router([Route("/pay", ACCEPTING, methods=["POST"]), status_route(store)])
    )
    assert started(await startup(starlette_app([admin, hosted], store=store)))


async def test_a_status_route_served_on_one_host_only_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The operation answers on any host, the status resource only on `admin.example`: a client
    on another host follows the Location to a 404."""
    store = MemoryStore()
    routes, _ = status_routes(store, "host")
    app = starlette_app([Route("/pay", ACCEPTING, methods=["POST"]), *routes], store=store)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        assert started(await startup(app))
    assert "which only api.example serves: a client on another host gets a 404" in caplog.text


@pytest.mark.parametrize(
    ("routes", "options"),
    [
        # The status resource at its default path, but the middleware points elsewhere.
        ([status_route(MemoryStore())], {"status_path": "/ops/status"}),
        # Something at the path, but not for GET.
        ([Route("/idempotency/status", pay, methods=["POST"])], {}),
        # A mount whose routes are visible, without the resource.
        ([Mount("/idempotency", routes=[Route("/other", pay)])], {}),
    ],
    ids=["other path", "not GET", "mount without it"],
)
async def test_a_status_route_the_location_does_not_reach_fails_startup(
    routes: list[BaseRoute], options: dict[str, Any]
) -> None:
    app = starlette_app(
        [Route("/pay", ACCEPTING, methods=["POST"]), *routes], store=MemoryStore(), **options
    )
    assert "accept_while_in_flight=True on POST /pay" in failure(await startup(app))


async def test_accept_while_in_flight_from_a_default_policy_is_checked_too() -> None:
    policy = Policy(accept_while_in_flight=True)
    plain = [Route("/a", pay, methods=["POST"]), Route("/b", pay, methods=["PUT"])]
    app = starlette_app(plain, store=MemoryStore(), default_policy=policy)
    assert "accept_while_in_flight=True on POST /a answers" in failure(await startup(app))
    by_name = starlette_app(plain, store=MemoryStore(), policies={"PUT /b": policy})
    assert "accept_while_in_flight=True on PUT /b answers" in failure(await startup(by_name))


async def test_a_status_path_behind_an_opaque_mount_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A mounted application whose routes cannot be seen may serve the path: not known, so a
    warning, not a failure."""
    app = starlette_app(
        [Route("/pay", ACCEPTING, methods=["POST"]), Mount("/idempotency", app=raw_asgi)],
        store=MemoryStore(),
    )
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        assert started(await startup(app))
    assert any(
        "accept_while_in_flight on POST /pay" in m and "cannot be seen" in m
        for m in messages(caplog, logging.WARNING)
    )


async def app_status(request: Request) -> Response:
    return JSONResponse({"mine": True})


async def test_an_app_route_shadowing_the_status_resource_fails_startup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by probing: a route of the app at the status path, listed before the status
    resource, took every GET of it, and startup passed: a client following a 202's Location
    got that route's answer. Decided: the app's route listed first fails startup when the app
    has the status resource too (a collision); alone there, it may be the app's own status
    resource, and startup only warns. The status resource listed first starts."""
    store = MemoryStore()
    pay_route = Route("/pay", ACCEPTING, methods=["POST"])
    mine = Route("/idempotency/status", app_status, methods=["GET"])
    shadowed = starlette_app([pay_route, mine, status_route(store)], store=store)
    mounted = starlette_app(
        [
            pay_route,
            Mount("/idempotency", routes=[Route("/status", app_status)]),
            status_route(store),
        ],
        store=store,
    )
    first = starlette_app([pay_route, status_route(store), mine], store=store)
    alone = starlette_app([pay_route, mine], store=store)
    message = failure(await startup(shadowed))
    assert "GET /idempotency/status goes to the app's own 'app_status'" in message
    assert "Put status_route(store) before it" in message
    assert "goes to the app's own 'app_status'" in failure(await startup(mounted))
    assert started(await startup(first))
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        assert started(await startup(alone))
    assert any(
        "goes to the app's own 'app_status'" in m and "it must answer as" in m
        for m in messages(caplog, logging.WARNING)
    )


def fastapi_accepting(with_status: bool) -> FastAPI:
    store = MemoryStore()
    app = FastAPI()

    @app.post("/pay", status_code=201)
    @idempotent(accept_while_in_flight=True)
    async def pay_endpoint() -> dict[str, bool]:
        return {"ok": True}

    if with_status:
        app.router.routes.append(status_route(store))
    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


async def test_a_fastapi_app_needs_the_status_route_too() -> None:
    message = failure(await startup(fastapi_accepting(with_status=False)))
    assert "accept_while_in_flight=True on POST /pay" in message
    assert started(await startup(fastapi_accepting(with_status=True)))


# -- the library's routes resolve tenants as the middleware does --------------------------------


def org_tenant(scope: Scope) -> str | None:
    return dict(scope["headers"]).get(b"x-org", b"").decode() or None


async def order(request: Request) -> Response:
    return JSONResponse({}, status_code=201)


async def test_a_library_route_resolving_tenants_otherwise_is_warned_at_startup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by probing: the status and token routes take their own tenant_resolver (default:
    the authenticated user), and an app whose middleware named tenants otherwise got tokens no
    claim ever accepted (every one `400 token-invalid`, "not a token issued to you") and a
    status resource that found nothing, without a word at startup."""
    store = MemoryStore()
    issuer = TokenIssuer(PostgresStore(dsn="postgresql://127.0.0.1:1/never"), secret=b"s" * 32)
    routes: list[BaseRoute] = [
        Route("/orders", order, methods=["POST"]),
        status_route(store),
        token_route(issuer),
        Mount("/same", routes=[status_route(store, tenant_resolver=org_tenant)]),
    ]
    app = starlette_app(routes, store=store, tenant_resolver=org_tenant)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        sent = await startup(app)
    assert sent[0]["type"] == "lifespan.startup.complete"
    warned = [m for m in messages(caplog, logging.WARNING) if "resolves tenants" in m]
    assert [m.split(" resolves")[0] for m in warned] == [
        "idempotency: /idempotency/status",
        "idempotency: /idempotency/tokens",
    ]
    assert "pass the middleware's tenant_resolver to it" in warned[0]
