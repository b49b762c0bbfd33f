"""The app the process-server tests run under gunicorn and granian (several worker processes on one
store): `tests.servers_app:create_app()`.

Environment:
- `SERVERS_APP_DSN` (required): the test database (migrated).
- `SERVERS_APP_GATES` (required): a directory. A handler writes `<key>.entered` (its PID) when
  it runs, then waits until `<key>.open` exists (at most `MAX_HOLD` seconds): a gate other
  processes can see and open.
- `SERVERS_APP_LEASE_SECONDS` (default 2.0): the lease route's lease.
- `SERVERS_APP_MISCONFIGURED=1`: a `policies` entry names no route (startup must fail).

Routes: `POST /credits/{k}` (transactional: its effect row is written on the claim's connection
before the gate), `POST /payouts/{k}` (lease mode, no reconciler: its effect row is written on the
fenced connection after the gate), `GET /state` (this worker's PID and its waiting duplicates).
Every answer carries `x-pid`, the worker that sent it (added outside the middleware, so a replay
carries the replaying worker's).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from tests.apps.concurrency import idempotency_middleware

#: The longest a handler waits for its gate (a test opens it, or kills the worker, long before).
MAX_HOLD = 60.0
#: The effects table (the test creates it before the workers start).
EFFECTS = "CREATE TABLE IF NOT EXISTS servers_effects (k text NOT NULL, pid int NOT NULL)"


async def _hold(request: Request) -> str:
    key = request.path_params["k"]
    gates = Path(os.environ["SERVERS_APP_GATES"])
    (gates / f"{key}.entered").write_text(str(os.getpid()))
    for _ in range(int(MAX_HOLD / 0.02)):
        if (gates / f"{key}.open").exists():
            break
        await asyncio.sleep(0.02)
    return str(key)


async def credit(request: Request) -> Response:
    conn = get_context(request).connection
    key = request.path_params["k"]
    await conn.execute("INSERT INTO servers_effects (k, pid) VALUES ($1, $2)", key, os.getpid())
    await _hold(request)
    return JSONResponse({"k": key, "pid": os.getpid()}, status_code=201)


async def payout(request: Request) -> Response:
    key = await _hold(request)
    conn = await get_context(request).fenced_connection()
    await conn.execute("INSERT INTO servers_effects (k, pid) VALUES ($1, $2)", key, os.getpid())
    return JSONResponse({"k": key, "pid": os.getpid()}, status_code=201)


class ServedBy:
    """Adds `x-pid` to every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_pid(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-pid", str(os.getpid()).encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_pid if scope["type"] == "http" else send)


def create_app() -> Starlette:
    store = PostgresStore(dsn=os.environ["SERVERS_APP_DSN"], min_size=1, max_size=5)
    lease = Policy(
        mode=Mode.LEASE,
        lease_seconds=float(os.environ.get("SERVERS_APP_LEASE_SECONDS", "2.0")),
        wait_seconds=30.0,
    )
    policies = {"POST /payouts/{k}": lease}
    if os.environ.get("SERVERS_APP_MISCONFIGURED"):
        policies["POST /payout/{k}"] = lease  # a typo: names no route

    async def state(request: Request) -> Response:
        waiters = idempotency_middleware(request.app).waiters.count
        return JSONResponse({"pid": os.getpid(), "waiters": waiters})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with store:
            yield

    app = Starlette(
        routes=[
            Route("/credits/{k}", credit, methods=["POST"]),
            Route("/payouts/{k}", payout, methods=["POST"]),
            Route("/state", state),
        ],
        middleware=[
            Middleware(ServedBy),
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies=policies,
                default_policy=Policy(wait_seconds=30.0),
                tenant_resolver=lambda scope: "tenant-a",
            ),
        ],
        lifespan=lifespan,
    )
    return app
