"""The startup warning for a guarded route that accepts larger bodies than a guarded request can
send is for larger ones only: a route whose own `max_body_size` is exactly the cap a guarded
request meets (a policy left at its default follows it) is not warned about."""

from __future__ import annotations

import logging

import pytest
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request

from idem_middleware import IdempotencyMiddleware, MemoryStore
from tests.apps import BearerBackend, client, key


async def test_a_route_limit_equal_to_the_cap_is_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fastapi = pytest.importorskip("fastapi")
    try:
        app = fastapi.FastAPI(max_body_size=100)
    except TypeError:  # pragma: no cover - a FastAPI before 0.165
        pytest.skip("no max_body_size")

    @app.post("/pay")
    async def pay(request: Request) -> dict[str, int]:
        return {"n": len(await request.body())}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(app) as c:
            ok = await c.post("/pay", content=b"x" * 100, headers=key("k"))
    assert ok.status_code == 200, ok.text
    assert not [r for r in caplog.records if "accepts request bodies" in r.getMessage()]
