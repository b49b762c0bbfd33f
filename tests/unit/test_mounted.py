"""IdempotencyMiddlewares below an app's router (`mounted.py`): what the operator's commands see
of them, and the outer middleware's refusal of an inner one whose policies would be ignored."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Host, Mount, Route, Router
from starlette.types import Message

from idem_middleware import (
    ConfigurationError,
    IdempotencyMiddleware,
    LeaseExpiry,
    MemoryStore,
    Mode,
    Policy,
    idempotent,
)
from idem_middleware.fastapi import install
from idem_middleware.ops import collect_policies, collect_reconcilers


async def startup_failure(app: Any) -> str | None:
    """The app's lifespan startup: its failure message, or None."""
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    failed: list[str] = []

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        if message["type"] == "lifespan.startup.failed":
            failed.append(message["message"])

    with contextlib.suppress(ConfigurationError):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    return failed[0] if failed else None


LEASE = Policy(mode=Mode.LEASE, on_lease_expiry=LeaseExpiry.TAKEOVER)


async def pay(request: Request) -> JSONResponse:
    return JSONResponse({})


def _names(app: Any) -> dict[str, tuple[str, str]]:
    return {
        name: (policy.mode.value, policy.on_lease_expiry.value)
        for name, policy in collect_policies(app).items()
    }


def test_the_middleware_of_a_mount_guards_its_routes_as_the_operator_commands_see_them() -> None:
    store = MemoryStore()
    inner = [Middleware(IdempotencyMiddleware, store=store, default_policy=LEASE)]

    @idempotent(wait_seconds=1)
    async def own(request: Request) -> JSONResponse:
        return JSONResponse({})

    deep = Mount(
        "/in",
        routes=[Route("/x", pay, methods=["PUT"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware, store=store, policies={"PUT h.example/v2/in/x": LEASE}
            )
        ],
    )
    app = Starlette(
        routes=[
            Mount("/api", routes=[Route("/pay", pay, methods=["POST"])], middleware=inner),
            Host("h.example", Router([Mount("/v2", routes=[deep])])),
            Route("/own", own, methods=["POST"]),
            Route("/plain", pay, methods=["POST"]),
        ]
    )
    assert _names(app) == {
        "POST /api/pay": ("lease", "takeover"),
        "PUT h.example/v2/in/x": ("lease", "takeover"),
        "POST /own": ("transactional", "unknown"),
    }


def test_the_middleware_of_a_mounted_app_guards_its_routes_named_from_the_top() -> None:
    store = MemoryStore()

    async def reconcile(record: Any) -> None: ...

    sub = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies={"POST /billing/pay": Policy(mode=Mode.LEASE, reconciler=reconcile)},
            )
        ],
    )
    app = Starlette(routes=[Mount("/billing", app=sub)])
    assert _names(app) == {"POST /billing/pay": ("lease", "unknown")}
    assert collect_reconcilers(app) == {"POST /billing/pay": reconcile}
    # Under an app with a middleware of its own, that one guards everything: its policies count.
    outer = Starlette(
        routes=[Mount("/billing", app=sub)],
        middleware=[Middleware(IdempotencyMiddleware, store=store, methods=())],
    )
    assert _names(outer) == {}


def _nested(inner_policies: dict[str, Policy], **outer: Any) -> FastAPI:
    store = MemoryStore()
    sub = FastAPI()

    @sub.post("/pay")
    async def sub_pay() -> dict[str, int]:
        return {"ok": 1}

    install(sub, store=store, policies=inner_policies)
    app = FastAPI()
    app.mount("/billing", sub)
    install(app, store=store, **outer)
    return app


async def test_an_inner_middleware_whose_policies_would_be_ignored_fails_the_startup() -> None:
    lease = {"POST /billing/pay": Policy(mode=Mode.LEASE, key_required=False)}
    failure = await startup_failure(_nested(lease))
    assert failure is not None
    assert "POST /billing/pay is guarded by this IdempotencyMiddleware" in failure
    assert "(lease, key optional" in failure
    assert "its policies never apply" in failure
    # The same policies in both: one guards, the other agrees, and startup passes.
    assert await startup_failure(_nested(lease, policies=lease)) is None
    # Nothing of the inner one's own: the outer one's guard is the inner one's default too.
    assert await startup_failure(_nested({})) is None
