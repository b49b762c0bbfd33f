"""Nobody starves, over a real socket: a client that never reads its held response leaves the
pool free while the server is stuck sending it. Real uvicorn on 127.0.0.1, a raw socket whose
receive buffer is tiny, real PostgreSQL, a pool of ONE connection: another request served while
the first one's send is blocked proves the claim's (or the fence's) connection went back first.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from tests.apps import BOUND, BearerBackend, idle_in_transaction, until
from tests.apps.servers import connection, read_response, uvicorn_serving

#: Far more than the kernel's socket buffers on loopback (tcp_wmem's 4 MB at most, and the
#: client's receive buffer of a few KB): the server's send must block on a client that never
#: reads.
BIG = 8 * 1024 * 1024
CHUNK = 64 * 1024


class SendWatch:
    """Outside the middleware: counts the body sends under way (started, not returned)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.pending = 0
        self.started = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watched(message: Any) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            self.pending += 1
            self.started += 1
            try:
                await send(message)
            finally:
                self.pending -= 1

        await self.app(scope, receive, watched if scope["type"] == "http" else send)


def _app(store: PostgresStore, mode: Mode, cap: int) -> SendWatch:
    async def big(request: Request) -> Response:
        ctx = get_context(request)
        conn = ctx.connection if mode is Mode.TRANSACTIONAL else await ctx.fenced_connection()
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, 'slow', 1)",
            ctx.tenant,
        )
        size = int(request.query_params.get("size", BIG))
        if size < CHUNK:
            return Response(b"x" * size, status_code=201, media_type="application/octet-stream")

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(size // CHUNK):
                yield b"x" * CHUNK

        return StreamingResponse(chunks(), status_code=201, media_type="application/octet-stream")

    policy = Policy(mode=mode, max_response_bytes=cap)
    inner = Starlette(
        routes=[Route("/big", big, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(
                IdempotencyMiddleware, store=store, default_policy=policy, acquire_timeout=2
            ),
        ],
    )
    return SendWatch(inner)


def _request(idem_key: str, token: str, size: int | None = None) -> bytes:
    query = "" if size is None else f"?size={size}"
    return (
        f"POST /big{query} HTTP/1.1\r\nhost: test\r\nauthorization: Bearer {token}\r\n"
        f'idempotency-key: "{idem_key}"\r\ncontent-type: application/json\r\n'
        "content-length: 2\r\n\r\n{}"
    ).encode()


@contextlib.asynccontextmanager
async def _never_reads(port: int, payload: bytes) -> AsyncIterator[socket.socket]:
    """A raw client with a tiny receive buffer that sends `payload` and never reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # (before connect: the window)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        await asyncio.get_running_loop().sock_sendall(sock, payload)
        yield sock
    finally:
        sock.close()


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("http", ["h11", "httptools"])
@pytest.mark.parametrize("kind", ["held", "stream"])
async def test_a_client_that_never_reads_its_response_holds_no_connection(
    db_dsn: str, pool: asyncpg.Pool[Any], mode: Mode, http: str, kind: str
) -> None:
    """`held`: 8 MB under the cap, sent in one message once the outcome committed (uvicorn
    buffers what the socket cannot take). `stream`: 8 MB over a 1 MB cap, streamed in 64 KB
    chunks after the early settlement: the server's send blocks on the client that never reads.
    Either way the pool's one connection serves another tenant meanwhile, nothing is left idle
    in transaction, and the stuck key's outcome is settled."""
    cap = 2 * BIG if kind == "held" else 1024 * 1024
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1) as store:
        app = _app(store, mode, cap)
        async with (
            uvicorn_serving(app, http) as port,
            _never_reads(port, _request("stuck", "demo-a")),
        ):
            await until(lambda: app.started > 0)
            if kind == "stream":
                await asyncio.sleep(0.3)
                assert app.pending == 1, "the stream's send must be blocked"
            assert await idle_in_transaction(pool) == 0
            settled = await pool.fetchval(
                "SELECT count(*) FROM idem_requests WHERE idem_key = 'stuck'"
                " AND state = 'succeeded' AND (body_omitted IS NOT NULL) = $1",
                kind == "stream",
            )
            assert settled == 1
            async with connection(port) as (reader, writer):
                writer.write(_request("other", "demo-b", size=10))
                status, _, body = await asyncio.wait_for(read_response(reader), BOUND)
                assert (status, body) == (201, b"x" * 10)
            if kind == "stream":
                assert app.pending == 1, "the stuck client's send must still be blocked"
    assert await pool.fetchval("SELECT count(*) FROM test_ledger WHERE account_id = 'slow'") == 2
