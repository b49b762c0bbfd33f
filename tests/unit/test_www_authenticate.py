"""A 401 carries the app's challenge in WWW-Authenticate (RFC 9110 §15.5.2 requires one): the
middleware's, the status route's and the token route's. Only the app knows its scheme, so it names
it (`www_authenticate`), checked when the middleware or route is made."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.openapi import document_openapi
from idem_middleware.status import status_route
from idem_middleware.tokens import TokenIssuer, token_route
from tests.apps import BearerBackend, assert_problem, client, key

CHALLENGE = 'Bearer realm="api", error="invalid_token"'


async def pay(request: Request) -> Response:
    return JSONResponse({"paid": True}, status_code=201)


def build(**options: Any) -> Starlette:
    store = MemoryStore()
    issuer = TokenIssuer(store, secret=b"s" * 32)
    challenge = {k: v for k, v in options.items() if k == "www_authenticate"}
    return Starlette(
        routes=[
            Route("/pay", pay, methods=["POST"]),
            status_route(store, **challenge),
            token_route(issuer, **challenge),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, **options),
        ],
    )


async def unauthenticated_answers(app: Starlette) -> list[httpx.Response]:
    async with client(app, token=None) as anonymous:
        return [
            await anonymous.post("/pay", json={}, headers=key("k1")),
            await anonymous.get(
                "/idempotency/status", params={"operation": "POST /pay", "key": "k1"}
            ),
            await anonymous.post("/idempotency/tokens", json={"operation": "POST /pay"}),
        ]


async def test_every_401_carries_the_configured_challenge() -> None:
    for reply in await unauthenticated_answers(build(www_authenticate=CHALLENGE)):
        assert_problem(reply, 401, "unauthenticated")
        assert reply.headers.get_list("www-authenticate") == [CHALLENGE]


async def test_only_a_401_carries_it() -> None:
    app = build(www_authenticate=CHALLENGE)
    async with client(app) as c:
        missing = await c.post("/pay", json={})
        paid = await c.post("/pay", json={}, headers=key("k1"))
        unknown = await c.get("/idempotency/status", params={"operation": "POST /x", "key": "k"})
    assert_problem(missing, 400, "missing-key")
    assert paid.status_code == 201
    assert_problem(unknown, 404, "record-not-found")
    for reply in (missing, paid, unknown):
        assert "www-authenticate" not in reply.headers


async def test_without_the_option_a_401_has_no_challenge_to_give() -> None:
    for reply in await unauthenticated_answers(build()):
        assert_problem(reply, 401, "unauthenticated")
        assert "www-authenticate" not in reply.headers


@pytest.mark.parametrize(
    "value",
    [
        "",
        " Bearer",
        "Bearer ",
        "Bearer\r\nSet-Cookie: s=1",
        'Basic realm="api',
        "Bearér",
        "Bearer,",
        b"Bearer",
        5,
    ],
)
def test_a_value_that_is_no_challenge_is_refused_when_made(value: Any) -> None:
    store = MemoryStore()
    with pytest.raises(ConfigurationError, match="www_authenticate"):
        IdempotencyMiddleware(Starlette(), store=store, www_authenticate=value)
    with pytest.raises(ConfigurationError, match="www_authenticate"):
        status_route(store, www_authenticate=value)
    with pytest.raises(ConfigurationError, match="www_authenticate"):
        token_route(TokenIssuer(store, secret=b"s" * 32), www_authenticate=value)


@pytest.mark.parametrize(
    "value",
    [
        "Bearer",
        'Basic realm="api", charset="UTF-8"',
        'Bearer realm="api", Basic realm="simple"',
        'Newauth realm="apps", type=1, title="Login to \\"apps\\""',
        "Negotiate YIIFyQYGKwYBBQUCoIIFvTCCBbmgMDAuBgkqhkiC9xIBAgIGCSqGSIb3EgECAg==",
    ],
)
def test_challenges_as_rfc_9110_writes_them_are_accepted(value: str) -> None:
    made = IdempotencyMiddleware(Starlette(), store=MemoryStore(), www_authenticate=value)
    assert made.tenants.challenge == value.encode()


def test_openapi_documents_the_challenge_on_the_401() -> None:
    schema = {"openapi": "3.1.0", "info": {}, "paths": {"/pay": {"post": {"responses": {}}}}}
    documented = document_openapi(schema, build(www_authenticate="Bearer"))
    unauthorized = documented["paths"]["/pay"]["post"]["responses"]["401"]
    assert unauthorized["headers"]["WWW-Authenticate"]["schema"]["example"] == "Bearer"

    schema = {"openapi": "3.1.0", "info": {}, "paths": {"/pay": {"post": {"responses": {}}}}}
    undocumented = document_openapi(schema, build())
    assert "headers" not in undocumented["paths"]["/pay"]["post"]["responses"]["401"]


def build_routes_without(**options: Any) -> Starlette:
    """The middleware given the challenge, the status and token routes not (as the token
    example of docs/tokens-and-outbox.md mounts its route)."""
    store = MemoryStore()
    issuer = TokenIssuer(store, secret=b"s" * 32)
    return Starlette(
        routes=[
            Route("/pay", pay, methods=["POST"]),
            status_route(store, **options),
            token_route(issuer, **options),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, www_authenticate=CHALLENGE),
        ],
    )


async def test_routes_given_no_challenge_take_the_middlewares() -> None:
    """They answered their 401s without any: RFC 9110's challenge missing, silently."""
    for reply in await unauthenticated_answers(build_routes_without()):
        assert_problem(reply, 401, "unauthenticated")
        assert reply.headers.get_list("www-authenticate") == [CHALLENGE]


async def test_routes_given_another_challenge_keep_it_and_startup_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="idem_middleware"):
        replies = await unauthenticated_answers(build_routes_without(www_authenticate="Basic"))
    assert [r.headers.get_list("www-authenticate") for r in replies] == [
        [CHALLENGE],
        ["Basic"],
        ["Basic"],
    ]
    warned = [r.getMessage() for r in caplog.records if "WWW-Authenticate" in r.getMessage()]
    assert len(warned) == 2, warned
    assert all("pass the middleware's www_authenticate to it" in line for line in warned)
