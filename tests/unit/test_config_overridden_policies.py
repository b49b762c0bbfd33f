"""A `policies` entry that guards a route whose endpoint is exempt (`@not_idempotent`, or
`@idempotent(guard=False)`): the endpoint's policy wins, so the route ran unguarded, the entry's
policy a startup warning its only trace. Two explicit settings that contradict each other, the
outcome a guard that is off: startup now fails, naming both and the fix. An entry the endpoint's
guarding policy overrides still only warns (the route is guarded either way)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, idempotent, not_idempotent
from tests.integration.test_startup_checks import messages, startup


def _app(endpoint: Any, **options: Any) -> Starlette:
    return Starlette(
        routes=[Route("/pay", endpoint, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                tenant_resolver=lambda scope: "t",
                **options,
            )
        ],
    )


@not_idempotent
async def exempt(request: Request) -> Response:
    return JSONResponse({})


@idempotent(guard=False)
async def unguarded(request: Request) -> Response:
    return JSONResponse({})


@idempotent(wait_seconds=1)
async def guarded(request: Request) -> Response:
    return JSONResponse({})


class Exempt(HTTPEndpoint):
    @not_idempotent
    async def post(self, request: Request) -> Response:
        return JSONResponse({})


@pytest.mark.parametrize("endpoint", [exempt, unguarded, Exempt])
async def test_a_guarding_entry_on_an_exempt_endpoint_fails_startup(endpoint: Any) -> None:
    sent = await startup(_app(endpoint, policies={"POST /pay": Policy(require_token=True)}))
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    message = sent[0]["message"]
    assert "policies['POST /pay']" in message
    assert "@not_idempotent" in message
    assert "unguarded" in message


async def test_an_exempt_entry_on_an_exempt_endpoint_starts() -> None:
    sent = await startup(_app(exempt, policies={"POST /pay": Policy(guard=False)}))
    assert sent[0]["type"] == "lifespan.startup.complete"


async def test_a_guarding_entry_on_a_guarded_endpoint_only_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "idem_middleware")
    sent = await startup(_app(guarded, policies={"POST /pay": Policy(wait_seconds=2)}))
    assert sent[0]["type"] == "lifespan.startup.complete"
    assert any("never applies" in m for m in messages(caplog, logging.WARNING))
