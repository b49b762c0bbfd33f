"""The app the server-edge tests run under uvicorn, hypercorn and granian (one process each, a
pool of ONE connection: a request that held a connection while its client did not read would
starve every other): `tests.edges_app:create_app()`.

Environment: `SERVERS_APP_DSN` (required, the migrated test database).

Routes: `POST /t/{k}` (transactional; its effect row, with the body's length, on the claim's
connection) and `POST /l/{k}` (lease mode; the row on the fenced connection). Each answers
`?size=N` bytes (10 by default); `/t/{k}?status=204` answers 204. The default policy takes
bodies of at most 1,000 bytes.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context

EFFECTS = "CREATE TABLE IF NOT EXISTS edges_effects (k text NOT NULL, n int NOT NULL)"
INSERT = "INSERT INTO edges_effects (k, n) VALUES ($1, $2)"
MAX_BODY = 1000


def _answer(request: Request, fill: bytes) -> Response:
    size = int(request.query_params.get("size", "10"))
    status = int(request.query_params.get("status", "201"))
    content = b"" if status == 204 else fill * size
    return Response(content, status_code=status, media_type="application/octet-stream")


async def transactional(request: Request) -> Response:
    body = await request.body()
    await get_context(request).connection.execute(INSERT, request.path_params["k"], len(body))
    return _answer(request, b"t")


async def lease(request: Request) -> Response:
    body = await request.body()
    conn = await get_context(request).fenced_connection()
    await conn.execute(INSERT, request.path_params["k"], len(body))
    return _answer(request, b"l")


def create_app() -> Starlette:
    store = PostgresStore(dsn=os.environ["SERVERS_APP_DSN"], min_size=1, max_size=1)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with store:
            yield

    return Starlette(
        routes=[
            Route("/t/{k}", transactional, methods=["POST"]),
            Route("/l/{k}", lease, methods=["POST"]),
            Route("/ping", lambda request: Response("ok")),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies={"POST /l/{k}": Policy(mode=Mode.LEASE, lease_seconds=2.0)},
                default_policy=Policy(wait_seconds=5.0, max_body_bytes=MAX_BODY),
                tenant_resolver=lambda scope: "tenant-a",
            )
        ],
        lifespan=lifespan,
    )
