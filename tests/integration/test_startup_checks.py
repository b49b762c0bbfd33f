"""Mistakes that used to turn protection off without a word now fail loudly: at startup where the
information exists (lifespan, or the first request when the server sends none), else on the
request, before any handler runs."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Message

from idem_middleware import (
    ConfigurationError,
    IdempotencyMiddleware,
    Mode,
    Policy,
    StoreError,
    idempotent,
)
from idem_middleware.fastapi import Idempotency, IdempotencyConnection, install
from idem_middleware.store import MemoryStore
from idem_middleware.store.postgres import PostgresStore
from tests.apps import BearerBackend, assert_problem, assert_replay_of, key


class Calls:
    def __init__(self) -> None:
        self.n = 0


def client(app: Any, token: str | None = "demo-a") -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://test",
        headers=headers,
    )


async def startup(app: Any) -> list[Message]:
    """Run the ASGI lifespan startup (and shutdown, if it started) as a server would; return
    what the app sent."""
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    with contextlib.suppress(ConfigurationError):  # a failed startup raises after reporting
        await app(scope, receive, send)
    return sent


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


# -- @idempotent without the middleware ---------------------------------------------------------


async def test_a_decorated_endpoint_without_the_middleware_refuses_to_run() -> None:
    calls = Calls()
    app = FastAPI()

    @app.post("/pay", status_code=201)
    @idempotent()
    async def pay() -> dict[str, int]:
        calls.n += 1
        return {"n": calls.n}

    async with client(app) as c:
        r = await c.post("/pay", headers=key("k1"))
        assert r.status_code == 500
    assert calls.n == 0


async def test_a_decorated_sync_endpoint_runs_under_the_middleware(
    pg_store: PostgresStore,
) -> None:
    """The check travels into the thread pool a plain `def` endpoint runs in."""
    calls = Calls()
    app = FastAPI()

    @app.post("/pay", status_code=201)
    @idempotent()
    def pay() -> dict[str, int]:
        calls.n += 1
        return {"n": calls.n}

    install(app, store=pg_store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    async with client(app) as c:
        first = await c.post("/pay", headers=key("k1"))
        assert first.status_code == 201, first.text
        assert_replay_of(await c.post("/pay", headers=key("k1")), first)
    assert calls.n == 1
    assert pay.__wrapped__() == {"n": 2}  # the handler itself, for a unit test


# -- methods=(): only explicit policies, and they always guard ----------------------------------


def opt_in_app(store: PostgresStore, calls: Calls) -> Starlette:
    @idempotent()
    async def pay(request: Request) -> Response:
        calls.n += 1
        return JSONResponse({"n": calls.n}, status_code=201)

    async def login(request: Request) -> Response:
        return JSONResponse({"token": "t"})

    return Starlette(
        routes=[
            Route("/pay", pay, methods=["POST"]),
            Route("/login", login, methods=["POST"]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, methods=()),
        ],
    )


async def test_an_explicit_policy_guards_its_route_whatever_methods_says(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    calls = Calls()
    async with client(opt_in_app(pg_store, calls)) as c:
        assert_problem(await c.post("/pay"), 400, "missing-key")
        first = await c.post("/pay", headers=key("k1"))
        assert first.status_code == 201
        assert_replay_of(await c.post("/pay", headers=key("k1")), first)
    assert calls.n == 1
    assert await pool.fetchval("SELECT operation FROM idem_requests") == "POST /pay"


async def test_methods_empty_guards_only_routes_with_a_policy(pg_store: PostgresStore) -> None:
    async with client(opt_in_app(pg_store, Calls()), token=None) as c:
        r = await c.post("/login")
        assert r.status_code == 200
        assert r.json() == {"token": "t"}


# -- a string where a collection belongs --------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: Policy(include_headers="x-api-version"),  # type: ignore[arg-type]
        lambda: Policy(exclude_fields="trace_id"),  # type: ignore[arg-type]
        lambda: Policy(exclude_fields=("trace_id", 3)),  # type: ignore[arg-type]
        lambda: IdempotencyMiddleware(Starlette(), store=None, methods="POST"),  # type: ignore[arg-type]
        lambda: IdempotencyMiddleware(Starlette(), store=None, policies=[("POST /x", Policy())]),  # type: ignore[arg-type]
        lambda: IdempotencyMiddleware(Starlette(), store=None, policies={"GET /x": Policy()}),  # type: ignore[arg-type]
    ],
)
def test_a_string_where_a_collection_belongs_is_a_configuration_error(build: Any) -> None:
    with pytest.raises(ConfigurationError):
        build()


def test_collections_of_names_are_accepted_in_any_form() -> None:
    policy = Policy(include_headers=["X-Api-Version"], exclude_fields={"trace_id"})  # type: ignore[arg-type]
    assert policy.include_headers == ("x-api-version",)
    assert policy.exclude_fields == ("trace_id",)


# -- startup lists what it guards, and what it never can ----------------------------------------


def mounted_app(store: PostgresStore, **options: Any) -> Starlette:
    @idempotent(mode=Mode.LEASE)
    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    @idempotent()
    async def read(request: Request) -> Response:
        return JSONResponse({})

    sub = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    return Starlette(
        routes=[Mount("/v2", sub), Route("/read", read, methods=["GET"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, **options),
        ],
    )


async def test_startup_lists_every_guarded_operation_and_warns_about_unreachable_policies(
    pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    app = mounted_app(pg_store)
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        sent = await startup(app)
    assert sent[0]["type"] == "lifespan.startup.complete"
    info = messages(caplog, logging.INFO)
    assert any(
        m.startswith("idempotency: guarding POST /v2/pay (lease, key required") for m in info
    )
    warnings = messages(caplog, logging.WARNING)
    assert any("policy on /read can never apply" in m for m in warnings), warnings


async def test_a_policies_key_that_names_no_route_fails_the_startup(
    pg_store: PostgresStore,
) -> None:
    """A typo or a prefix left out (`POST /v1/pay` for `/v2/pay`). Before, a warning, and the
    route it meant ran under the default policy, or unguarded with `methods=()`."""
    for methods in ({"POST", "PATCH"}, ()):
        app = mounted_app(pg_store, policies={"POST /v1/pay": Policy()}, methods=methods)
        sent = await startup(app)
        assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
        assert (
            "policies['POST /v1/pay'] matches no route, so it can never apply (did you mean "
            "'POST /v2/pay'?)" in sent[0]["message"]
        )
        # A second lifespan (a second `with TestClient(app)`) fails as the first did: it
        # started, and only its requests answered the misconfiguration.
        again = await startup(app)
        assert [m["type"] for m in again] == ["lifespan.startup.failed"], again
    app = mounted_app(pg_store, policies={"DELETE /nothing/like/it": Policy()})
    sent = await startup(app)
    assert sent[0]["message"].endswith("matches no route, so it can never apply")


def plain_app(**options: Any) -> Starlette:
    async def endpoint(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    return Starlette(
        routes=[
            Route("/pay", endpoint, methods=["POST"]),
            Route("/items/{id}", endpoint, methods=["GET", "PUT"]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore(), **options),
        ],
    )


async def test_a_method_no_route_serves_is_named_at_startup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`methods={"PUT", "POSTT"}` was accepted without a word: POSTT guards nothing, and the
    POST route it meant ran unguarded."""
    sent = await startup(plain_app(methods={"PUT", "POSTT"}))
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
    assert (
        "methods names 'POSTT', which no route serves, so it guards nothing, while the POST "
        "routes go unguarded (did you mean 'POST'?)" in sent[0]["message"]
    )
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        sent = await startup(plain_app(methods={"POST", "DELETE"}))
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    assert messages(caplog, logging.WARNING) == [
        "idempotency: methods names 'DELETE', which no route serves: it guards nothing"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        sent = await startup(plain_app())  # the default's PATCH: no route serves it, no word
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    assert messages(caplog, logging.WARNING) == []


def sub_app_with_its_own_middleware(policies: dict[str, Policy]) -> Starlette:
    """A sub-app that installs the middleware itself, mounted at /api by an app without it (no
    lifespan reaches it: its check runs at its first request)."""

    async def pay(request: Request) -> Response:
        return JSONResponse({}, 201)

    sub = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore(), policies=policies),
        ],
    )
    return Starlette(routes=[Mount("/api", app=sub)])


async def test_a_mounted_sub_apps_check_names_its_routes_as_its_requests_are_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its requests are named `POST /api/pay` (the mount's prefix, as the router above names
    them), so that is the key its `policies` must use. The check once named the route `POST
    /pay`: it warned that the right key matched no route and listed the route under the default
    policy, and with the key `POST /pay` it listed a lease-mode route that its requests never
    got. The key `POST /pay` now matches no route, which refuses its requests (500), naming the
    right key."""
    lease = Policy(mode=Mode.LEASE)
    app = sub_app_with_its_own_middleware({"POST /api/pay": lease})
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        async with client(app) as c:
            r = await c.post("/api/pay", json={}, headers=key("k"))
    assert r.status_code == 201, r.text
    assert (
        "idempotency: guarding POST /api/pay (lease, key required, wait 5s, lease 30s, "
        "unknown on expiry)" in messages(caplog, logging.INFO)
    )
    assert messages(caplog, logging.WARNING) == []

    caplog.clear()
    app = sub_app_with_its_own_middleware({"POST /pay": lease})
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        async with client(app) as c:
            r = await c.post("/api/pay", json={}, headers=key("k"))
    assert r.status_code == 500, r.text  # refused, not run under the default policy
    info = messages(caplog, logging.INFO)
    assert not any("(lease" in m for m in info), info
    errors = messages(caplog, logging.ERROR)
    assert any(
        "policies['POST /pay'] matches no route, so it can never apply (did you mean "
        "'POST /api/pay'?)" in m
        for m in errors
    ), errors


# -- IdempotencyConnection on a route that is not guarded ---------------------------------------


def connection_app(store: PostgresStore, calls: Calls) -> FastAPI:
    app = FastAPI()

    @app.post("/unguarded")
    async def unguarded(conn: IdempotencyConnection) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.post("/leased")
    @idempotent(mode=Mode.LEASE)
    async def leased(conn: IdempotencyConnection) -> dict[str, bool]:
        return {"ok": True}

    @app.post("/fine")
    @idempotent()
    async def fine(idem: Idempotency) -> dict[str, bool]:
        return {"ok": True}

    install(app, store=store, methods=())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


async def test_a_connection_dependency_on_an_unguarded_route_fails_startup(
    pg_store: PostgresStore,
) -> None:
    sent = await startup(connection_app(pg_store, Calls()))
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    message = sent[0]["message"]
    assert "POST /unguarded declares IdempotencyConnection but is not guarded" in message
    assert "POST /leased declares IdempotencyConnection but is in lease mode" in message
    assert "/fine" not in message


async def test_without_lifespan_the_check_fails_the_first_request(
    pg_store: PostgresStore,
) -> None:
    calls = Calls()
    async with client(connection_app(pg_store, calls)) as c:
        for _ in range(2):
            assert (await c.post("/unguarded")).status_code == 500
    assert calls.n == 0


# -- authentication missing, or in the wrong order ----------------------------------------------


def auth_app(store: PostgresStore, calls: Calls, middleware: list[Middleware]) -> Starlette:
    async def pay(request: Request) -> Response:
        calls.n += 1
        return JSONResponse({}, status_code=201)

    @idempotent(allow_anonymous=True)
    async def anonymous(request: Request) -> Response:
        calls.n += 1
        return JSONResponse({}, status_code=201)

    return Starlette(
        routes=[
            Route("/pay", pay, methods=["POST"]),
            Route("/anonymous", anonymous, methods=["POST"]),
        ],
        middleware=middleware,
    )


async def test_no_authentication_before_the_middleware_is_a_500_that_says_why(
    pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    calls = Calls()
    app = auth_app(pg_store, calls, [Middleware(IdempotencyMiddleware, store=pg_store)])
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        await startup(app)
        async with client(app) as c:
            for n in range(2):
                r = await c.post("/pay", headers=key(f"k{n}"))
                problem = assert_problem(r, 500, "server-misconfigured")
                assert "misconfigured" in problem["detail"]
            # A route that accepts anonymous callers needs no authentication.
            assert (await c.post("/anonymous", headers=key("k9"))).status_code == 201
    assert calls.n == 1
    startup_warnings = [
        m for m in messages(caplog, logging.WARNING) if "AuthenticationMiddleware" in m
    ]
    assert len(startup_warnings) == 1
    assert "add Starlette's AuthenticationMiddleware after installing" in startup_warnings[0]
    errors = [m for m in messages(caplog, logging.ERROR) if "no 'user'" in m]
    assert len(errors) == 1, "logged once, not per request"


async def test_authentication_only_inside_the_middleware_fails_the_startup(
    pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Listed after it, AuthenticationMiddleware names the user after the tenant is resolved:
    no request could be named, and the anonymous route's authenticated callers would be
    refused one by one (tests/integration/test_authentication_inside.py). Found by probing:
    this only warned."""
    ours = Middleware(IdempotencyMiddleware, store=pg_store)
    auth = Middleware(AuthenticationMiddleware, backend=BearerBackend())
    calls = Calls()
    app = auth_app(pg_store, calls, [ours, auth])
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        sent = await startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
    assert "AuthenticationMiddleware runs after IdempotencyMiddleware" in sent[0]["message"]
    assert "add Starlette's AuthenticationMiddleware after installing" in sent[0]["message"]
    assert calls.n == 0


# -- a store the app's lifespan does not open ----------------------------------------------------


def store_app(store: PostgresStore, *, opens: bool, enabled: bool = True) -> FastAPI:
    """A FastAPI app whose lifespan opens `store`, or (the newcomer's mistake) does not."""
    closed: list[bool] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        try:
            async with contextlib.AsyncExitStack() as stack:
                if opens:
                    await stack.enter_async_context(store)
                yield
        finally:
            closed.append(True)

    app = FastAPI(lifespan=lifespan)
    app.state.closed = closed
    install(app, store=store, enabled=enabled, tenant_resolver=lambda scope: "t")

    @app.post("/pay")
    async def pay() -> dict[str, bool]:
        return {"ok": True}

    return app


async def test_a_lifespan_that_does_not_open_the_store_fails_the_startup(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the server started and answered every guarded request 503 store-unavailable
    ("retry it with the same Idempotency-Key"), for as long as it ran."""
    app = store_app(PostgresStore(dsn=db_dsn), opens=False)
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        sent = await startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "without opening the store" in sent[0]["message"]
    assert "lifespan=store_lifespan(store)" in sent[0]["message"]
    assert any("without opening the store" in m for m in messages(caplog, logging.ERROR))
    assert app.state.closed == [True]  # the app's own lifespan was unwound, not left running


async def test_a_store_the_lifespan_opens_or_a_given_pool_starts(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    app = store_app(PostgresStore(dsn=db_dsn), opens=True)
    sent = await startup(app)
    assert [m["type"] for m in sent] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    # A pool of the app's own serves without open(); so does the kill switch, which uses no store.
    for app in (
        store_app(PostgresStore(pool=pool), opens=False),
        store_app(PostgresStore(dsn=db_dsn), opens=False, enabled=False),
        store_app(MemoryStore(), opens=False),  # type: ignore[arg-type]
    ):
        sent = await startup(app)
        assert sent[0]["type"] == "lifespan.startup.complete", sent


async def test_without_a_lifespan_an_unopened_store_says_how_to_open_it(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx's ASGITransport (or a TestClient outside `with`) runs no lifespan: the first
    request's check logs the fix, and the 503's log says it too (before: 'call `await
    store.open()` first', which a FastAPI app never calls)."""
    app = store_app(PostgresStore(dsn=db_dsn), opens=True)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(app) as c:
            r = await c.post("/pay", json={}, headers=key("k"))
    assert_problem(r, 503, "store-unavailable")
    (error,) = messages(caplog, logging.ERROR)
    assert "the store is not open" in error
    assert "`with TestClient(app) as client:`" in error
    assert "No lifespan startup reached the middleware: the server sends none (daphne" in error
    logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert logged
    assert logged[0].exc_info is not None
    assert "`with TestClient(app) as client:`" in str(logged[0].exc_info[1])


async def test_a_closed_store_says_it_is_closed(db_dsn: str) -> None:
    store = PostgresStore(dsn=db_dsn)
    assert not store.is_open
    async with store:
        assert store.is_open
    assert not store.is_open
    with pytest.raises(StoreError, match="the store is closed"):
        _ = store.pool


# -- @idempotent above the route decorator -------------------------------------------------------


def decorated_above_app() -> FastAPI:
    app = FastAPI()
    install(app, store=MemoryStore(), methods=(), tenant_resolver=lambda scope: "t")

    @idempotent(mode=Mode.LEASE)  # the newcomer's order: FastAPI registered `payout` itself
    @app.post("/payouts")
    async def payout() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/orders")
    @idempotent()
    async def order() -> dict[str, bool]:
        return {"ok": True}

    return app


async def test_idempotent_above_the_route_decorator_fails_the_startup() -> None:
    """Before, the route was registered without its policy and nothing said so: with
    `methods=()` it ran unguarded, and otherwise under the default policy (transactional, where
    the decorator asked for lease mode)."""
    sent = await startup(decorated_above_app())
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
    message = sent[0]["message"]
    assert "payout (/payouts) has @idempotent above its route decorator" in message
    assert "order" not in message.replace("decorator", "")  # the right order is fine


async def test_idempotent_above_the_route_decorator_refuses_requests_without_a_lifespan() -> None:
    async with client(decorated_above_app()) as c:
        r = await c.post("/payouts", json={}, headers=key("k"))
    assert r.status_code == 500


async def test_an_endpoint_registered_both_with_and_without_idempotent_is_no_mistake() -> None:
    app = FastAPI()

    async def pay() -> dict[str, bool]:
        return {"ok": True}

    app.post("/guarded")(idempotent()(pay))
    app.post("/plain")(pay)
    install(app, store=MemoryStore(), tenant_resolver=lambda scope: "t")
    sent = await startup(app)
    assert sent[0]["type"] == "lifespan.startup.complete", sent


async def test_one_handler_wrapped_for_each_app_a_factory_builds_is_no_mistake() -> None:
    """An app factory wrapping a module's handler with `idempotent()(handler)`, called twice
    in one process (a fixture per test, say). Found by probing: the second app failed its
    startup check ("@idempotent above its route decorator") and answered every request 500:
    its wrapper had copied the handler's link to the first app's wrapper."""

    async def pay() -> dict[str, bool]:
        return {"ok": True}

    def create_app() -> FastAPI:
        app = FastAPI()
        app.post("/pay", status_code=201)(idempotent()(pay))
        install(app, store=MemoryStore(), tenant_resolver=lambda scope: "t")
        return app

    first, second = create_app(), create_app()
    for app in (first, second):
        sent = await startup(app)
        assert sent[0]["type"] == "lifespan.startup.complete", sent
        async with client(app) as c:
            assert (await c.post("/pay", headers=key("k"))).status_code == 201
