"""An included FastAPI route of a class with its own `matches` that takes the request's path but
not its method answers PARTIAL: FastAPI goes on to the next route, and so must the middleware.
Taken for the route, its `@not_idempotent` let a guarded PATCH run unguarded (fail open)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request

from idem_middleware import IdempotencyMiddleware, MemoryStore, not_idempotent
from tests.apps import BearerBackend, client, key


def custom_class_app(ran: list[str]) -> Any:
    fastapi = pytest.importorskip("fastapi")
    from fastapi.routing import APIRoute

    class Custom(APIRoute):  # (a class with its own `matches`: asked as FastAPI asks it)
        def matches(self, scope: Any) -> Any:
            return super().matches(scope)

    included = fastapi.APIRouter(route_class=Custom)

    @included.post("/items")
    @not_idempotent
    async def search(request: Request) -> dict[str, str]:
        ran.append("search")
        return {"ran": "search"}

    app = fastapi.FastAPI()
    app.include_router(included, prefix="/api")

    @app.patch("/api/items")
    async def update(request: Request) -> dict[str, str]:
        ran.append("update")
        return {"ran": "update"}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


async def test_a_partial_match_in_an_included_router_is_not_the_route() -> None:
    ran: list[str] = []
    app = custom_class_app(ran)
    async with client(app) as c:
        unkeyed = await c.patch("/api/items", json={})
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        assert ran == []
        first = await c.patch("/api/items", json={}, headers=key("p1"))
        again = await c.patch("/api/items", json={}, headers=key("p1"))
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert again.headers.get("idempotent-replayed") == "true"
        assert ran == ["update"]
        assert (await c.post("/api/items", json={})).status_code == 200  # exempt: unguarded
    assert ran == ["update", "search"]
