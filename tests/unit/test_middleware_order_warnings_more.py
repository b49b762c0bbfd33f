"""Startup warnings about the app's middleware list no test pinned: a middleware of unknown
kind listed inside IdempotencyMiddleware is named (it may change the path or method the route
was found by, sending requests to a route seen as unguarded); and an app whose guarded routes
all allow anonymous callers is not told it lacks authentication."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from tests.apps import BearerBackend, client, key


class MethodOverride:
    """A middleware of the app's own that could honour X-HTTP-Method-Override."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


async def pay(request: Request) -> Response:
    return JSONResponse({}, status_code=201)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_an_unknown_middleware_inside_is_named_at_startup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
            Middleware(MethodOverride),  # (listed after: runs inside)
        ],
    )
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(app) as c:
            assert (await c.post("/pay", json={}, headers=key("k"))).status_code == 201
    warned = [m for m in _messages(caplog) if "MethodOverride runs after" in m]
    assert len(warned) == 1, _messages(caplog)
    assert "they run unguarded" in warned[0]


async def test_an_app_of_anonymous_routes_only_is_not_told_to_authenticate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                default_policy=Policy(allow_anonymous=True),
            )
        ],
    )
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(app, token=None) as c:
            assert (await c.post("/pay", json={}, headers=key("k"))).status_code == 201
    assert not [m for m in _messages(caplog) if "no AuthenticationMiddleware" in m]
