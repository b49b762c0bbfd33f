"""The lease-mode test app (tests/integration/test_lease_mode.py, tests/lease_app.py).

The "downstream system" is a table written in autocommit on its own connection: a bank outside
our transaction that deduplicates by the downstream key (`ON CONFLICT (dkey) DO NOTHING`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idem_middleware import (
    IdempotencyContext,
    IdempotencyMiddleware,
    Mode,
    Outcome,
    Policy,
    StaleGeneration,
    get_context,
)
from idem_middleware.reconcile import (
    Happened,
    NotHappened,
    ReconcileContext,
    Reconciler,
    Reconciliation,
)
from idem_middleware.status import status_route
from idem_middleware.store.base import Store
from tests.apps.clients import BearerBackend
from tests.apps.transactional import LEDGER_INSERT

DOWNSTREAM_SCHEMA = """
CREATE TABLE IF NOT EXISTS test_downstream (
    dkey text PRIMARY KEY, amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS test_lease_calls (
    id bigserial PRIMARY KEY, dkey text NOT NULL, generation bigint NOT NULL, pid integer NOT NULL
);
"""


async def reset_downstream(pool: Any) -> None:
    """Create (once) and empty the downstream tables; the caller's `pool` fixture empties ours."""
    await pool.execute(DOWNSTREAM_SCHEMA)
    await pool.execute("DELETE FROM test_downstream; DELETE FROM test_lease_calls")


async def send_downstream(pool: Any, dkey: str, amount: int) -> None:
    """The downstream effect: the bank records a transfer once per downstream key (autocommit)."""
    await pool.execute(
        "INSERT INTO test_downstream (dkey, amount) VALUES ($1, $2) ON CONFLICT (dkey) DO NOTHING",
        dkey,
        amount,
    )


async def downstream_rows(pool: Any, dkey: str | None = None) -> int:
    if dkey is None:
        n: int = await pool.fetchval("SELECT count(*) FROM test_downstream")
    else:
        n = await pool.fetchval("SELECT count(*) FROM test_downstream WHERE dkey = $1", dkey)
    return n


def downstream_reconciler(pool: Any) -> Reconciler:
    """Asks the bank about the downstream key: found -> Happened (201), absent -> NotHappened."""

    async def reconcile(rc: ReconcileContext) -> Reconciliation:
        amount = await pool.fetchval(
            "SELECT amount FROM test_downstream WHERE dkey = $1", rc.downstream_key
        )
        if amount is None:
            return NotHappened()
        return Happened.json(201, {"dkey": rc.downstream_key, "amount": amount, "reconciled": True})

    return reconcile


class DownstreamError(Exception):
    """The bank call failed: before sending ("before") or with the answer lost ("after")."""


@dataclass
class Step:
    """What one execution of the lease handler does; the default runs clean and answers 201."""

    status: int = 201
    downstream: bool = True
    #: Raise DownstreamError "before" or "after" the downstream effect, or "late": after the
    #: hold and the fenced write (when the lease may have been taken over meanwhile).
    fail: str | None = None
    #: Write a test_ledger row on the fenced connection "before" the downstream call or "after"
    #: the hold (a StaleGeneration there is caught and recorded in `LeaseProbe.stale`), or
    #: "after, uncaught": the same write, a StaleGeneration left to escape the handler.
    fence: str | None = None
    gate: asyncio.Event | None = None
    delay: float = 0.0
    declare: Outcome | None = None
    #: After the fenced write, a statement fails on the fenced connection and the handler
    #: swallows the error and answers anyway (its transaction is now aborted).
    poison: bool = False
    #: Answer with a `text/event-stream` response (one that cannot be held) of this status.
    stream: bool = False


class LeaseProbe:
    """Scripts the lease handler per execution (`steps`, consumed in order) and records its runs."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.calls = 0
        self.contexts: list[IdempotencyContext] = []
        self.entered = asyncio.Event()
        self.stale: list[int] = []

    def next_step(self) -> Step:
        return self.steps.pop(0) if self.steps else Step()


async def fenced_ledger(ctx: IdempotencyContext, account: str, amount: int) -> None:
    """A business write that must commit with the outcome (the debit of a payout, say)."""
    conn = await ctx.fenced_connection()
    await conn.execute(LEDGER_INSERT, ctx.tenant, account, amount)


async def payout(request: Request) -> Response:
    probe: LeaseProbe = request.app.state.probe
    step = probe.next_step()
    probe.calls += 1
    ctx = get_context(request)
    probe.contexts.append(ctx)
    if step.declare is not None:
        ctx.declare(step.declare)  # declared up front: it holds however the handler ends
    payload = await request.json()
    account, amount = payload["account"], payload["amount"]
    if step.fence == "before":
        await fenced_ledger(ctx, account, amount)
    if step.fail == "before":
        raise DownstreamError("connection refused: nothing was sent")
    if step.downstream:
        await send_downstream(request.app.state.pool, ctx.downstream_key, amount)
    if step.fail == "after":
        raise DownstreamError("timed out: the transfer may have happened")
    probe.entered.set()
    if step.gate is not None:
        await step.gate.wait()
    if step.delay:
        await asyncio.sleep(step.delay)
    if step.fence == "after":
        try:
            await fenced_ledger(ctx, account, amount)
        except StaleGeneration:
            probe.stale.append(ctx.generation)
    elif step.fence == "after, uncaught":
        await fenced_ledger(ctx, account, amount)
    if step.fail == "late":
        raise DownstreamError("the bank answered 500 to the late call")
    if step.poison:
        conn = await ctx.fenced_connection()
        with contextlib.suppress(Exception):
            await conn.execute("SELECT 1 / 0")
    if step.stream:

        async def events() -> AsyncIterator[bytes]:
            yield f"data: {ctx.generation}\n\n".encode()

        return StreamingResponse(events(), status_code=step.status, media_type="text/event-stream")
    return JSONResponse(
        {
            "dkey": ctx.downstream_key,
            "amount": amount,
            "generation": ctx.generation,
            "call": probe.calls,
        },
        status_code=step.status,
    )


PAYOUTS = "/payouts"
LEASE_POLICY = Policy(mode=Mode.LEASE, lease_seconds=5.0, wait_seconds=0.3)


def build_lease_app(
    store: Store, pool: Any, policy: Policy = LEASE_POLICY, **middleware_options: Any
) -> Starlette:
    """`POST /payouts` under `policy`; `pool` is the bank's (the downstream table's) connection."""
    app = Starlette(
        routes=[Route(PAYOUTS, payout, methods=["POST"]), status_route(store)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies={f"POST {PAYOUTS}": policy},
                **middleware_options,
            ),
        ],
    )
    app.state.probe = LeaseProbe()
    app.state.pool = pool
    return app
