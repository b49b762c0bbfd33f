"""A mounted Starlette app's own app-level `max_body_size` (its limiter wraps the app, not its
routes) caps a guarded body to its routes before any claim: a body over it is the middleware's
`413 body-too-large` and the handler never runs, not a claim made then refused by the app."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from idem_middleware import IdempotencyMiddleware, MemoryStore
from tests.apps import BearerBackend, assert_problem, client, key


async def test_a_mounted_apps_own_limit_caps_a_guarded_body_before_the_claim() -> None:
    runs: list[int] = []

    async def pay(request: Request) -> JSONResponse:
        runs.append(len(await request.body()))
        return JSONResponse({"ok": 1}, status_code=201)

    try:
        sub = Starlette(routes=[Route("/pay", pay, methods=["POST"])], max_body_size=100)
    except TypeError:  # pragma: no cover - a Starlette before 1.10
        pytest.skip("no app-level max_body_size")
    store = MemoryStore()
    app = Starlette(
        routes=[Mount("/v1", app=sub)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )
    async with client(app) as c:
        big = await c.post("/v1/pay", content=b"x" * 200, headers=key("k"))
        small = await c.post("/v1/pay", content=b"x" * 50, headers=key("k"))
    assert_problem(big, 413, "body-too-large")
    assert small.status_code == 201, small.text  # the key was not taken by the refused body
    assert runs == [50]
