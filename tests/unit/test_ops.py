"""`ops.guarded_operations` (the CLI's and OpenAPI's list) is the middleware's own resolution:
exactly the operations startup lists, through Host, Mount and included routers."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, Router
from starlette.types import Message

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, idempotent, not_idempotent
from idem_middleware.fastapi import install
from idem_middleware.ops import collect_policies, find_middleware, guarded_operations


async def endpoint(request: Request) -> JSONResponse:
    return JSONResponse({})


def routed_app() -> FastAPI:
    app = FastAPI()
    install(
        app,
        store=MemoryStore(),
        methods=("POST", "DELETE"),
        policies={"PUT /things/{thing_id}": Policy(wait_seconds=1)},
    )

    @app.post("/pay")
    async def pay() -> dict[str, str]:
        return {}

    @app.put("/things/{thing_id}")
    async def put_thing(thing_id: int) -> dict[str, str]:
        return {}

    @app.post("/ping")
    @not_idempotent
    async def ping() -> dict[str, str]:
        return {}

    orders = APIRouter(prefix="/orders")

    @orders.post("/{order_id}")
    async def order(order_id: str) -> dict[str, str]:
        return {}

    @orders.patch("/{order_id}")
    @idempotent(key_required=False)
    async def patch_order(order_id: str) -> dict[str, str]:
        return {}

    @orders.get("/{order_id}")
    async def read_order(order_id: str) -> dict[str, str]:
        return {}

    app.include_router(orders, prefix="/v1")
    admin = Starlette(routes=[Route("/reset/{n:int}", endpoint, methods=["POST", "GET"])])
    app.mount("/admin", admin)
    app.host("api.example", Router(routes=[Route("/charge", endpoint, methods=["DELETE"])]))
    return app


async def run_startup(app: Any) -> None:
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        assert not message["type"].endswith(".failed"), message

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)


async def test_ops_lists_exactly_what_startup_logs(caplog: pytest.LogCaptureFixture) -> None:
    app = routed_app()
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        await run_startup(app)
    guarding = re.compile(r"idempotency: guarding (.+) \(")
    logged = [m[1] for r in caplog.records if (m := guarding.match(r.getMessage()))]
    listed = [op.name for op in guarded_operations(app)]
    assert listed == logged
    assert set(listed) == {
        "POST /pay",
        "PUT /things/{thing_id}",
        "POST /v1/orders/{order_id}",
        "PATCH /v1/orders/{order_id}",
        "POST /admin/reset/{n:int}",
        "DELETE api.example/charge",
    }
    paths = {op.name: op.path_format for op in guarded_operations(app)}
    assert paths["PUT /things/{thing_id}"] == "/things/{thing_id}"
    assert paths["POST /admin/reset/{n:int}"] == "/admin/reset/{n}"
    assert paths["DELETE api.example/charge"] == "/charge"
    assert collect_policies(app)["PUT /things/{thing_id}"].wait_seconds == 1


async def test_the_running_middleware_is_the_one_read() -> None:
    app = routed_app()
    built = find_middleware(app)
    assert isinstance(built, IdempotencyMiddleware)  # from add_middleware's arguments
    await run_startup(app)  # builds the middleware stack
    running = find_middleware(app)
    assert running is not None
    assert running is not built
    assert running is find_middleware(app)  # the instance serving requests
    wrapped = IdempotencyMiddleware(app, store=MemoryStore(), methods=())
    assert find_middleware(wrapped) is wrapped
    # The outermost middleware is the one read: here, only routes with their own policy.
    assert [op.name for op in guarded_operations(wrapped)] == ["PATCH /v1/orders/{order_id}"]


def test_without_a_middleware_only_endpoints_with_a_policy_are_listed() -> None:
    app = FastAPI()

    @app.post("/plain")
    async def plain() -> dict[str, str]:
        return {}

    @app.post("/own")
    @idempotent()
    async def own() -> dict[str, str]:
        return {}

    assert [op.name for op in guarded_operations(app)] == ["POST /own"]
