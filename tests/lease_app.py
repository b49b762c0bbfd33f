"""A lease-mode app for the process tests: `uvicorn tests.lease_app:create_app --factory`.

Environment:
- `LEASE_APP_DSN` (required): the test database (migrated, with the downstream tables).
- `LEASE_APP_LEASE_SECONDS` (default 1.0) and `LEASE_APP_WAIT_SECONDS` (default 5.0).

Three routes, one handler, one policy each (what a lapsed lease becomes):
- `POST /payouts/reconciled`: unknown, then the reconciler asks the downstream table;
- `POST /payouts/plain`: unknown, and no reconciler (a retry gets 409 outcome-unknown);
- `POST /payouts/takeover`: taken over by the next retry, which runs the handler again.

The handler logs its run in `test_lease_calls` (autocommit: it survives a crash), makes the
downstream effect, then sleeps for the `x-hold` header's seconds (a header, so not part of the
fingerprint: the retry is the same request without it) before answering. A test SIGKILLs the
process during that sleep: after the effect, before any response.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import (
    IdempotencyMiddleware,
    LeaseExpiry,
    Mode,
    Policy,
    PostgresStore,
    get_context,
)
from tests.apps import BearerBackend, downstream_reconciler, send_downstream

#: The longest a handler may be held (a test kills the process long before).
MAX_HOLD = 60.0


async def payout(request: Request) -> Response:
    ctx = get_context(request)
    store: PostgresStore = request.app.state.store
    payload = await request.json()
    await store.pool.execute(
        "INSERT INTO test_lease_calls (dkey, generation, pid) VALUES ($1, $2, $3)",
        ctx.downstream_key,
        ctx.generation,
        os.getpid(),
    )
    await send_downstream(store.pool, ctx.downstream_key, payload["amount"])
    hold = float(request.headers.get("x-hold", "0"))
    if hold:
        await asyncio.sleep(min(hold, MAX_HOLD))
    return JSONResponse(
        {
            "dkey": ctx.downstream_key,
            "amount": payload["amount"],
            "generation": ctx.generation,
            "pid": os.getpid(),
        },
        status_code=201,
    )


def create_app() -> Starlette:
    dsn = os.environ["LEASE_APP_DSN"]
    base = Policy(
        mode=Mode.LEASE,
        lease_seconds=float(os.environ.get("LEASE_APP_LEASE_SECONDS", "1.0")),
        wait_seconds=float(os.environ.get("LEASE_APP_WAIT_SECONDS", "5.0")),
    )
    store = PostgresStore(dsn=dsn, min_size=1, max_size=5)

    # The reconciler reads the downstream table through the store's pool, once it is open.
    class _Pool:
        async def fetchval(self, query: str, *args: object) -> object:
            return await store.pool.fetchval(query, *args)

    policies = {
        "POST /payouts/reconciled": base.replace(reconciler=downstream_reconciler(_Pool())),
        "POST /payouts/plain": base,
        "POST /payouts/takeover": base.replace(on_lease_expiry=LeaseExpiry.TAKEOVER),
    }

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await store.open()
        try:
            yield
        finally:
            await store.close()

    app = Starlette(
        routes=[
            Route(f"/payouts/{name}", payout, methods=["POST"])
            for name in ("reconciled", "plain", "takeover")
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, policies=policies),
        ],
        lifespan=lifespan,
    )
    app.state.store = store
    return app
