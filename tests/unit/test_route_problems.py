"""The library's own routes (status, tokens) refuse with the middleware's problem+json: the same
builder, the same `problem_base`, the same tenant resolution."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.routing import BaseRoute

from idem_middleware import MemoryStore
from idem_middleware.responses import DEFAULT_PROBLEM_BASE
from idem_middleware.status import status_route
from idem_middleware.tokens import TokenIssuer, token_route
from tests.apps import BearerBackend

BASE = "https://errors.example/idempotency/"
STATUS = "/idempotency/status"
TOKENS = "/idempotency/tokens"


def routes(**options: Any) -> list[BaseRoute]:
    store = MemoryStore()
    issuer = TokenIssuer(store, secret=b"s" * 32)
    return [status_route(store, **options), token_route(issuer, **options)]


def app(*, authenticated: bool = True, **options: Any) -> Starlette:
    middleware = [Middleware(AuthenticationMiddleware, backend=BearerBackend())]
    return Starlette(routes=routes(**options), middleware=middleware if authenticated else [])


async def call(app: Starlette, method: str, url: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.request(method, url, **kwargs)


def problem(response: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert int(response.headers["content-length"]) == len(response.content)
    body: dict[str, Any] = response.json()
    assert body["type"] == type_
    assert body["status"] == status
    assert body["title"]
    assert body["detail"]
    return body


@pytest.mark.parametrize("base", [DEFAULT_PROBLEM_BASE, BASE])
async def test_a_status_route_problem_uses_the_problem_base(base: str) -> None:
    options = {} if base == DEFAULT_PROBLEM_BASE else {"problem_base": base}
    served = app(**options)
    anonymous = await call(served, "GET", STATUS, params={"operation": "POST /x", "key": "k"})
    problem(anonymous, 401, base + "unauthenticated")
    auth = {"authorization": "Bearer demo-a"}
    bad = await call(served, "GET", STATUS, params={"operation": "x", "key": "k"}, headers=auth)
    problem(bad, 400, base + "invalid-key")


@pytest.mark.parametrize("base", [DEFAULT_PROBLEM_BASE, BASE])
async def test_a_token_route_problem_uses_the_problem_base(base: str) -> None:
    options = {} if base == DEFAULT_PROBLEM_BASE else {"problem_base": base}
    served = app(**options)
    anonymous = await call(served, "POST", TOKENS, json={"operation": "POST /x"})
    problem(anonymous, 401, base + "unauthenticated")
    auth = {"authorization": "Bearer demo-a"}
    bad = await call(served, "POST", TOKENS, content=b"[]", headers=auth)
    problem(bad, 400, base + "body-invalid")


@pytest.mark.parametrize(("method", "url"), [("GET", STATUS), ("POST", TOKENS)])
async def test_a_route_with_no_authentication_before_it_is_a_500_that_says_why(
    caplog: pytest.LogCaptureFixture, method: str, url: str
) -> None:
    served = app(authenticated=False, problem_base=BASE)
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        for _ in range(2):
            r = await call(served, method, url, params={"operation": "POST /x", "key": "k"})
            assert "misconfigured" in problem(r, 500, BASE + "server-misconfigured")["detail"]
    assert len([r for r in caplog.records if "no 'user'" in r.getMessage()]) == 1
