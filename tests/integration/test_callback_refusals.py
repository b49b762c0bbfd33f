"""An `HTTPException` the app's own callbacks raise before any claim (the tenant resolver, a key
source function), as a FastAPI app reusing its `get_current_user` logic raises it: a 4xx is that
status as problem+json (its detail, its headers), nothing claimed or stored, logged at DEBUG by
its status only; a 5xx or any other exception goes on to the server. The library's status and
token routes answer a resolver's 4xx the same way. On both stores."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from http import HTTPStatus
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi import HTTPException as FastAPIHTTPException
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from idem_middleware import Policy
from idem_middleware.fastapi import install
from idem_middleware.observe import Event
from idem_middleware.status import status_route
from idem_middleware.store.base import State, Store
from idem_middleware.tokens import TokenIssuer, token_route
from tests.apps import assert_problem

SECRET_TOKEN = "s3cr3t-credential-of-a-client"
GOOD = {"authorization": "Bearer good"}
BAD = {"authorization": f"Bearer {SECRET_TOKEN}"}
CHALLENGE = 'Bearer error="invalid_token"'
HTTP_EXCEPTIONS = [FastAPIHTTPException, StarletteHTTPException]


def bearer(scope: Scope) -> str | None:
    """The verified tenant, or None when no credential came at all."""
    authorization = Headers(scope=scope).get("authorization")
    if authorization is None:
        return None
    if authorization != "Bearer good":
        # What a FastAPI app's `get_current_user` raises (its detail echoing the credential).
        raise FastAPIHTTPException(
            401, f"invalid token {SECRET_TOKEN}", headers={"WWW-Authenticate": CHALLENGE}
        )
    return "tenant-a"


async def async_bearer(scope: Scope) -> str | None:
    return bearer(scope)


def raising(exc: Exception, *, asynchronous: bool) -> Callable[..., Any]:
    """A callback (resolver or key function, any arguments) that raises `exc`."""

    def sync(*args: Any) -> Any:
        raise exc

    async def async_(*args: Any) -> Any:
        raise exc

    return async_ if asynchronous else sync


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        self.events.append(event)

    def timed(self, name: str, attributes: Mapping[str, Any]) -> AbstractContextManager[None]:
        return nullcontext()


def build(store: Store, resolver: Callable[[Scope], Any], **options: Any) -> FastAPI:
    app = FastAPI()
    app.state.calls = 0

    @app.post("/orders", status_code=201)
    async def create_order() -> dict[str, int]:
        app.state.calls += 1
        return {"n": app.state.calls}

    app.router.routes.append(status_route(store, tenant_resolver=resolver))
    issuer = TokenIssuer(store, secret=b"s" * 32)
    app.router.routes.append(token_route(issuer, tenant_resolver=resolver))
    install(app, store=store, tenant_resolver=resolver, **options)
    return app


def client(app: FastAPI, *, raise_app_exceptions: bool = False) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://t")


async def stored(store: Store) -> int:
    """Records the store holds, in any state (none may come of a refused request)."""
    return len(await store.list_records(states=tuple(State)))


async def assert_nothing_claimed(app: FastAPI, c: httpx.AsyncClient, store: Store) -> None:
    """No handler ran, nothing is stored, and the key is free: the same key, with a good
    credential, runs the handler (not a replay)."""
    assert app.state.calls == 0
    assert await stored(store) == 0
    fresh = await c.post("/orders", headers={**GOOD, "idempotency-key": "k1"})
    assert fresh.status_code == 201, fresh.text
    assert "idempotent-replayed" not in fresh.headers
    assert app.state.calls == 1


# -- the tenant resolver ---------------------------------------------------------------------


@pytest.mark.parametrize("resolver", [bearer, async_bearer])
async def test_a_resolvers_401_is_its_status_detail_and_challenge_as_problem_json(
    store: Store, resolver: Callable[[Scope], Any]
) -> None:
    # The middleware has a challenge of its own: the app's, on its own exception, wins.
    app = build(store, resolver, www_authenticate="Basic")
    async with client(app) as c:
        refused = await c.post("/orders", headers={**BAD, "idempotency-key": "k1"})
        problem = assert_problem(refused, 401, "unauthenticated")
        assert problem["detail"] == f"invalid token {SECRET_TOKEN}"
        assert refused.headers.get_list("www-authenticate") == [CHALLENGE]
        await assert_nothing_claimed(app, c, store)


@pytest.mark.parametrize("exception", HTTP_EXCEPTIONS)
@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_401_without_a_challenge_takes_the_middlewares_under_its_problem_base(
    store: Store, exception: type[StarletteHTTPException], asynchronous: bool
) -> None:
    resolver = raising(exception(401), asynchronous=asynchronous)
    base = "https://errors.example/"
    app = build(store, resolver, www_authenticate="Bearer", problem_base=base)
    async with client(app) as c:
        refused = await c.post("/orders", headers={"idempotency-key": "k1"})
    assert refused.status_code == 401
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json() == {
        "type": base + "unauthenticated",
        "title": "Authentication is required",
        "status": 401,
        "detail": "Unauthorized",  # (Starlette's default detail: the status's phrase)
    }
    assert refused.headers.get_list("www-authenticate") == ["Bearer"]
    assert app.state.calls == 0


@pytest.mark.parametrize(
    ("exc", "title", "detail", "headers"),
    [
        (FastAPIHTTPException(403, "missing scope orders:write"), "Forbidden", None, {}),
        # An `HTTPStatus` member is an int: answered, and sent as a plain one.
        (StarletteHTTPException(HTTPStatus.NOT_FOUND), "Not Found", "Not Found", {}),
        (
            StarletteHTTPException(429, "slow down", headers={"Retry-After": "7"}),
            "Too Many Requests",
            None,
            {"retry-after": "7"},
        ),
        # FastAPI takes any JSON as a detail; a problem's detail is a string: the phrase.
        (FastAPIHTTPException(400, detail={"code": "bad"}), "Bad Request", "Bad Request", {}),
    ],
)
async def test_another_4xx_is_about_blank_with_its_status_detail_and_headers(
    store: Store,
    exc: StarletteHTTPException,
    title: str,
    detail: str | None,
    headers: dict[str, str],
) -> None:
    app = build(store, raising(exc, asynchronous=False))
    async with client(app) as c:
        refused = await c.post("/orders", headers={**GOOD, "idempotency-key": "k1"})
    assert refused.status_code == exc.status_code
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.content.startswith(
        b'{"type":"about:blank","title":"%s","status":%d,' % (title.encode(), exc.status_code)
    )
    assert refused.json() == {
        "type": "about:blank",
        "title": title,
        "status": exc.status_code,
        "detail": detail or exc.detail,
    }
    assert refused.headers["content-length"] == str(len(refused.content))
    for name, value in headers.items():
        assert refused.headers[name] == value
    assert "www-authenticate" not in refused.headers
    assert app.state.calls == 0


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize(
    "exc", [FastAPIHTTPException(503, "auth service down"), RuntimeError("the resolver broke")]
)
async def test_a_5xx_or_any_other_exception_from_the_resolver_goes_on_to_the_server(
    store: Store, exc: Exception, asynchronous: bool
) -> None:
    app = build(store, raising(exc, asynchronous=asynchronous))
    async with client(app, raise_app_exceptions=True) as c:
        with pytest.raises(type(exc)) as raised:
            await c.post("/orders", headers={**GOOD, "idempotency-key": "k1"})
    assert raised.value is exc  # the app's own exception, not one of the library's
    assert app.state.calls == 0
    assert await stored(store) == 0


# -- a key source function -------------------------------------------------------------------


@pytest.mark.parametrize("exception", HTTP_EXCEPTIONS)
@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_key_functions_4xx_is_answered_after_the_resolvers_401(
    store: Store, exception: type[StarletteHTTPException], asynchronous: bool
) -> None:
    exc = exception(403, "this webhook's sender is not allowed")
    policy = Policy(key_source=raising(exc, asynchronous=asynchronous))
    app = build(store, bearer, www_authenticate="Bearer", default_policy=policy)
    async with client(app) as c:
        refused = await c.post("/orders", headers=GOOD, json={"id": "evt-1"})
        # No caller at all: the 401 comes first, as for a key the function finds invalid.
        anonymous = await c.post("/orders", json={"id": "evt-1"})
    assert refused.status_code == 403
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["detail"] == "this webhook's sender is not allowed"
    assert refused.json()["type"] == "about:blank"
    assert_problem(anonymous, 401, "unauthenticated")
    assert app.state.calls == 0
    assert await stored(store) == 0


@pytest.mark.parametrize(
    "exc", [StarletteHTTPException(500, "key service down"), ValueError("the function broke")]
)
async def test_a_5xx_or_any_other_exception_from_a_key_function_goes_on(
    store: Store, exc: Exception
) -> None:
    app = build(store, bearer, default_policy=Policy(key_source=raising(exc, asynchronous=True)))
    async with client(app, raise_app_exceptions=True) as c:
        with pytest.raises(type(exc)) as raised:
            await c.post("/orders", headers=GOOD, json={"id": "evt-1"})
    assert raised.value is exc
    assert app.state.calls == 0
    assert await stored(store) == 0


# -- the library's own routes ------------------------------------------------------------------


@pytest.mark.parametrize("resolver", [bearer, async_bearer])
async def test_the_status_and_token_routes_answer_the_resolvers_4xx_as_the_middleware(
    store: Store, resolver: Callable[[Scope], Any]
) -> None:
    """Inside the app, FastAPI's handler answered `{"detail": ...}` as application/json: the
    library's routes speak problem+json, as the guarded routes do for the same resolver."""
    app = build(store, resolver)
    async with client(app) as c:
        status = await c.get(
            "/idempotency/status", params={"operation": "POST /orders", "key": "k1"}, headers=BAD
        )
        token = await c.post("/idempotency/tokens", json={"operation": "POST /orders"}, headers=BAD)
    for refused in (status, token):
        problem = assert_problem(refused, 401, "unauthenticated")
        assert problem["detail"] == f"invalid token {SECRET_TOKEN}"
        assert refused.headers.get_list("www-authenticate") == [CHALLENGE]
    assert status.headers["cache-control"] == "no-store"


# -- what it tells the logs and observers; headers a server refuses ----------------------------


async def test_a_refusal_is_logged_at_debug_by_its_status_and_counted_as_rejected(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    app = build(store, bearer, observers=recorder)
    with caplog.at_level(logging.DEBUG, logger="idem_middleware"):
        async with client(app) as c:
            refused = await c.post("/orders", headers={**BAD, "idempotency-key": "k-logged"})
    assert refused.status_code == 401
    said = [r for r in caplog.records if "refused the request" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.DEBUG, "idempotency: the tenant resolver refused the request with 401")
    ]
    for record in caplog.records:  # neither the credential nor the key, at any level
        text = record.getMessage() + repr(record.__dict__)
        assert SECRET_TOKEN not in text
        assert "k-logged" not in text
    assert recorder.events == [Event.REJECTED]


async def test_headers_no_server_sends_are_left_out_and_named(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    exc = FastAPIHTTPException(
        403,
        headers={
            "X-Reason": "scope",
            "X-Split": "a\r\nSet-Cookie: forged=1",
            "X-Wide": "\u20ac",
            "Content-Type": "text/html",
        },
    )
    app = build(store, raising(exc, asynchronous=False))
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(app) as c:
            refused = await c.post("/orders", headers={**GOOD, "idempotency-key": "k1"})
    assert refused.status_code == 403
    assert refused.headers["x-reason"] == "scope"
    assert "x-split" not in refused.headers
    assert "set-cookie" not in refused.headers
    assert "x-wide" not in refused.headers
    assert refused.headers.get_list("content-type") == ["application/problem+json"]
    warned = [r.getMessage() for r in caplog.records if "HTTPException" in r.getMessage()]
    assert len(warned) == 1
    assert [r.levelno for r in caplog.records if "HTTPException" in r.getMessage()] == [
        logging.WARNING
    ]
    assert "x-split" in warned[0]
    assert "x-wide" in warned[0]
    assert "forged" not in warned[0]  # named, never quoted
