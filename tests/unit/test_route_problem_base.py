"""The library's own routes (status, tokens) answer under the `problem_base` of the middleware
whose startup check saw them: one API, one problem vocabulary. A route given another base than
that middleware's, or seen by two middlewares with different bases, fails the check."""

from __future__ import annotations

import functools
import logging
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.errors import ConfigurationError, StoreError
from idem_middleware.responses import DEFAULT_PROBLEM_BASE
from idem_middleware.status import status_route
from idem_middleware.store.base import RecordKey
from idem_middleware.tokens import MAX_TOKEN_REQUEST_BYTES, TokenIssuer, token_route
from tests.apps import BearerBackend
from tests.integration.test_startup_checks import startup as lifespan_startup

BASE = "https://errors.example/idempotency/"
OTHER = "urn:example:problem:"
STATUS = "/idempotency/status"
TOKENS = "/idempotency/tokens"
AUTH = {"authorization": "Bearer demo-a"}


async def pay(request: Request) -> Response:
    return JSONResponse({}, status_code=201)


class Unavailable(MemoryStore):
    """A store whose reads fail as a database that cannot be reached does (StoreError)."""

    async def peek(self, key: RecordKey) -> Any:
        raise StoreError("the database cannot be reached")

    async def issue_token(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreError("the database cannot be reached")


def library_route(kind: str, store: MemoryStore, **options: Any) -> BaseRoute:
    if kind == "status":
        return status_route(store, **options)
    return token_route(TokenIssuer(store, secret=b"s" * 32), **options)


async def another_secrets_intent(store: MemoryStore) -> None:
    """The intent `i`'s token for POST /pay, issued to tenant-a under another secret: the token
    route's issuer, asked for it, answers TokenConflict."""
    await TokenIssuer(store, secret=b"o" * 32).issue("tenant-a", "POST /pay", intent_id="i")


def app(route: BaseRoute, *bases: str) -> Starlette:
    """`route` and a guarded `POST /pay` (it takes tokens) behind the bearer authentication and
    one IdempotencyMiddleware per base in `bases`, the first outermost."""
    store = MemoryStore()
    policies = {"POST /pay": Policy(require_token=True)}
    middleware = [Middleware(AuthenticationMiddleware, backend=BearerBackend())]
    middleware += [
        Middleware(IdempotencyMiddleware, store=store, problem_base=base, policies=policies)
        for base in bases
    ]
    return Starlette(routes=[route, Route("/pay", pay, methods=["POST"])], middleware=middleware)


async def startup(served: Starlette) -> str | None:
    """Run the ASGI lifespan startup (and shutdown) as a server would: None when it completes,
    else the failed check's message."""
    sent = await lifespan_startup(served)
    if sent[0] == {"type": "lifespan.startup.complete"}:
        return None
    assert len(sent) == 1, sent
    assert sent[0]["type"] == "lifespan.startup.failed", sent
    message = str(sent[0]["message"])
    assert message.startswith("idem_middleware: "), message
    return message.removeprefix("idem_middleware: ")


def problem_type(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    kind: str = response.json()["type"]
    return kind


async def requests(served: Starlette, kind: str) -> list[tuple[httpx.Response, int, str]]:
    """Problems the route answers, each with its status and kind, asked without a lifespan (the
    first request runs the middleware's check)."""
    transport = httpx.ASGITransport(app=served, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        if kind == "status":
            op = {"operation": "POST /pay"}
            asked = {**op, "key": "k"}
            return [
                (await c.get(STATUS, params=asked), 401, "unauthenticated"),
                (
                    await c.get(STATUS, params=op, headers={**AUTH, "idempotency-key": "k"}),
                    404,
                    "record-not-found",
                ),
                (await c.post(STATUS, params=asked, headers=AUTH), 405, "method-not-allowed"),
                (await c.get(STATUS, params={"key": "k"}, headers=AUTH), 400, "invalid-key"),
            ]
        too_large = b" " * (MAX_TOKEN_REQUEST_BYTES + 1)
        intent = {"operation": "POST /pay", "intent_id": "i"}
        return [
            (await c.post(TOKENS, json={"operation": "POST /pay"}), 401, "unauthenticated"),
            (await c.post(TOKENS, json=intent, headers=AUTH), 409, "token-conflict"),
            (await c.post(TOKENS, content=too_large, headers=AUTH), 413, "body-too-large"),
            (await c.get(TOKENS, headers=AUTH), 405, "method-not-allowed"),
            (await c.post(TOKENS, content=b"[]", headers=AUTH), 400, "body-invalid"),
            (
                await c.post(TOKENS, json={"operation": "POST /x"}, headers=AUTH),
                400,
                "body-invalid",
            ),
        ]


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_a_route_without_a_base_answers_under_the_middlewares(kind: str) -> None:
    store = MemoryStore()
    await another_secrets_intent(store)
    served = app(library_route(kind, store), BASE)
    for response, status, name in await requests(served, kind):
        assert problem_type(response, status) == BASE + name


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_its_503_too(kind: str) -> None:
    served = app(library_route(kind, Unavailable()), BASE)
    transport = httpx.ASGITransport(app=served, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as c:
        if kind == "status":
            r = await c.get(
                STATUS, params={"operation": "POST /pay"}, headers={"idempotency-key": "k"}
            )
        else:
            r = await c.post(TOKENS, json={"operation": "POST /pay"})
    assert problem_type(r, 503) == BASE + "store-unavailable"


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_after_a_lifespan_startup_too(kind: str) -> None:
    store = MemoryStore()
    await another_secrets_intent(store)
    served = app(library_route(kind, store), BASE)
    assert await startup(served) is None
    for response, status, name in await requests(served, kind):
        assert problem_type(response, status) == BASE + name


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_the_same_base_given_to_both_is_fine(kind: str) -> None:
    store = MemoryStore()
    await another_secrets_intent(store)
    served = app(library_route(kind, store, problem_base=BASE), BASE)
    assert await startup(served) is None
    for response, status, name in await requests(served, kind):
        assert problem_type(response, status) == BASE + name


@pytest.mark.parametrize("kind", ["status", "tokens"])
@pytest.mark.parametrize(("route_base", "base"), [(DEFAULT_PROBLEM_BASE, BASE), (BASE, OTHER)])
async def test_a_route_given_another_base_fails_the_startup(
    kind: str, route_base: str, base: str
) -> None:
    served = app(library_route(kind, MemoryStore(), problem_base=route_base), base)
    message = await startup(served)
    assert message is not None
    path = STATUS if kind == "status" else TOKENS
    assert f"the {kind} route at {path} was given problem_base={route_base!r}" in message
    assert f"has problem_base={base!r}" in message


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_without_a_lifespan_a_route_given_another_base_refuses_every_request(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As any failed check: every request is a 500 (the ConfigurationError goes to the server's
    error handling), the error logged once, naming the route and both bases."""
    served = app(library_route(kind, MemoryStore(), problem_base=OTHER), BASE)
    transport = httpx.ASGITransport(app=served, raise_app_exceptions=False)
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            answers = [await c.get(STATUS), await c.post(TOKENS), await c.post("/pay")]
    assert [r.status_code for r in answers] == [500, 500, 500]
    errors = [r.getMessage() for r in caplog.records if "problem_base" in r.getMessage()]
    assert len(errors) == 1
    assert f"route at {STATUS if kind == 'status' else TOKENS}" in errors[0]
    assert repr(OTHER) in errors[0]
    assert repr(BASE) in errors[0]


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_two_middlewares_with_different_bases_over_one_route_fail_the_startup(
    kind: str,
) -> None:
    served = app(library_route(kind, MemoryStore()), BASE, OTHER)
    message = await startup(served)
    assert message is not None
    assert "seen by two IdempotencyMiddlewares with different ones" in message
    assert repr(BASE) in message
    assert repr(OTHER) in message
    assert "Give the middlewares one problem_base" in message


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_two_middlewares_with_one_base_over_one_route_are_fine(kind: str) -> None:
    store = MemoryStore()
    await another_secrets_intent(store)
    served = app(library_route(kind, store), BASE, BASE)
    assert await startup(served) is None
    for response, status, name in await requests(served, kind):
        assert problem_type(response, status) == BASE + name


@pytest.mark.parametrize("base", [5, "", "https://errors.example/idempotency", "problems/"])
@pytest.mark.parametrize("kind", ["status", "tokens"])
def test_a_routes_own_base_is_checked_as_the_middlewares_when_the_route_is_made(
    kind: str, base: Any
) -> None:
    # (A route no middleware sees answers under its own base: nothing later would refuse it.)
    store = MemoryStore()
    make: Any = (
        functools.partial(status_route, store)
        if kind == "status"
        else functools.partial(token_route, TokenIssuer(store, secret=b"s" * 32))
    )
    with pytest.raises(ConfigurationError, match="problem_base must be an absolute URI prefix"):
        make(problem_base=base)
