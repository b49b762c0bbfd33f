"""The app the soak test (tests/integration/test_soak.py) runs in one uvicorn process:
`tests.apps.soak:create_app()`, behind the bearer authentication (tests/apps/clients.py).

Environment: `SOAK_DSN` (required, the migrated test database, with `LEDGER` created).

Routes:
- `POST /t` (transactional: its ledger row on the claim's connection) and `POST /l` (lease
  mode, lapsed leases taken over: its row on the fenced connection). Query: `sleep=S` sleeps S
  seconds after the write, `fail=1` raises after it, `size=N` answers N bytes instead of the
  JSON `{"run"}` (unique per execution, so a replay is told from a re-run). The paths are
  fixed (the key only in its header): the middleware's route cache does not grow with keys,
  and the process's live objects after a soak are comparable with another's.
- `GET /idempotency/status` (the status resource) and `GET /ping`.
- `GET /debug/state`: what the process holds (tasks, the pool, the middleware's waiters and
  tenant slots, the store's listener and timers, RSS, live GC objects). Test app only.
"""

from __future__ import annotations

import asyncio
import gc
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from idem_middleware.policy import LeaseExpiry
from idem_middleware.status import status_route
from tests.apps.clients import BearerBackend
from tests.apps.concurrency import idempotency_middleware

LEDGER = (
    "CREATE TABLE IF NOT EXISTS soak_ledger (tenant text NOT NULL, route text NOT NULL,"
    " k text NOT NULL, run text NOT NULL)"
)
_INSERT = "INSERT INTO soak_ledger (tenant, route, k, run) VALUES ($1, $2, $3, $4)"
MAX_BODY = 4096
APPLICATION = "soak"
POOL_MAX = 6
LEASE = Policy(
    mode=Mode.LEASE,
    lease_seconds=1.0,
    wait_seconds=2.0,
    on_lease_expiry=LeaseExpiry.TAKEOVER,
    max_body_bytes=MAX_BODY,
)


async def _run(request: Request, route: str, conn: Any) -> Response:
    run = uuid.uuid4().hex
    ctx = get_context(request)
    await request.body()
    await conn.execute(_INSERT, ctx.tenant, route, ctx.key, run)
    query = request.query_params
    if "sleep" in query:
        await asyncio.sleep(float(query["sleep"]))
    if "fail" in query:
        raise RuntimeError("the handler failed after its write")
    if "size" in query:
        body = b"x" * int(query["size"])
        return Response(body, status_code=201, media_type="application/octet-stream")
    return JSONResponse({"run": run}, status_code=201)


async def transactional(request: Request) -> Response:
    return await _run(request, "t", get_context(request).connection)


async def lease(request: Request) -> Response:
    return await _run(request, "l", await get_context(request).fenced_connection())


def _timer_items(delayed: Any) -> int:
    """Items a `Delayed` still holds (on any loop)."""
    servings = [delayed._main, *(delayed._others or {}).values()]
    return sum(len(s.items) for s in servings if s is not None)


def state(store: PostgresStore, middleware: IdempotencyMiddleware) -> dict[str, Any]:
    from idem_middleware import lease_executor, transactional

    gc.collect()
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    listener = store._listener
    timers = [transactional._WATCH, store._checkouts, *store._deadlines.values()]
    timers += lease_executor._RENEWALS.values()
    return {
        "tasks": len(asyncio.all_tasks()),
        "pool_size": store.pool.get_size(),
        "pool_idle": store.pool.get_idle_size(),
        "waiters": middleware.waiters.count,
        "waiting_keys": len(middleware.waiters._events),
        "tenant_slots": dict(middleware.tenant_slots._held),
        "listener_waiters": len(listener._waiters),
        "listener_pending": len(listener._pending),
        "timer_items": sum(_timer_items(t) for t in timers),
        "rss": rss,
        "gc_objects": len(gc.get_objects()),
    }


def create_app() -> Starlette:
    store = PostgresStore(
        dsn=os.environ["SOAK_DSN"], min_size=2, max_size=POOL_MAX, application_name=APPLICATION
    )

    async def debug_state(request: Request) -> Response:
        return JSONResponse(state(store, idempotency_middleware(request.app)))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with store:
            yield

    return Starlette(
        routes=[
            Route("/t", transactional, methods=["POST"]),
            Route("/l", lease, methods=["POST"]),
            Route("/ping", lambda request: Response("ok")),
            Route("/debug/state", debug_state),
            status_route(store),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies={"POST /l": LEASE},
                default_policy=Policy(wait_seconds=2.0, max_body_bytes=MAX_BODY),
                max_waiters=64,
                max_tenant_connections=4,
                www_authenticate="Bearer",
            ),
        ],
        lifespan=lifespan,
    )
