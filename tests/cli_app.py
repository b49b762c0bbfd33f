"""A tiny app whose lease-mode route has a reconciler, for `idem-middleware reconcile --app`."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, LeaseExpiry, MemoryStore, Mode, idempotent
from idem_middleware.reconcile import (
    Happened,
    NotHappened,
    ReconcileContext,
    Reconciliation,
    StillUnknown,
)


async def reconcile(ctx: ReconcileContext) -> Reconciliation:
    # Stands in for asking a bank: the verdict depends on the key, so the test can check each.
    if ctx.key == "happened":
        return Happened.json(201, {"reconciled": True})
    if ctx.key == "not-happened":
        return NotHappened()
    return StillUnknown("the bank is closed")


@idempotent(mode=Mode.LEASE, reconciler=reconcile)
async def payouts(request: Request) -> JSONResponse:
    return JSONResponse({}, status_code=201)


# A route whose lapsed leases the client's retry takes over; it has no reconciler.
@idempotent(mode=Mode.LEASE, on_lease_expiry=LeaseExpiry.TAKEOVER)
async def transfers(request: Request) -> JSONResponse:
    return JSONResponse({}, status_code=201)


app = Starlette(
    routes=[
        Route("/payouts", payouts, methods=["POST"]),
        Route("/transfers", transfers, methods=["POST"]),
    ],
    middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
)


async def async_factory() -> Starlette:
    """An async factory, which `reconcile --app` cannot await (refused, naming it)."""
    return app
