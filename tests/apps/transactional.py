"""The transactional test app: `build_app` and its handlers (a credit on the claim's transaction,
streams, large and binary bodies ...), with the `Probe` that counts and holds their executions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from idem_middleware import (
    IdempotencyMiddleware,
    Outcome,
    Policy,
    PostgresStore,
    get_context,
    not_idempotent,
)
from idem_middleware.status import status_route
from idem_middleware.store.base import Store
from tests.apps.clients import BearerBackend


class QueryLog:
    """Every message a pool's connections send (asyncpg's query logger), whitespace-normalised."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def __call__(self, record: Any) -> None:
        self.queries.append(" ".join(record.query.split()))

    async def attach(self, conn: Any) -> None:
        """A pool's `init`: log this connection's messages."""
        conn.add_query_logger(self)


@asynccontextmanager
async def logged_pool(dsn: str, log: QueryLog, **pool_options: Any) -> AsyncIterator[Any]:
    """A pool (1 to 4 connections unless `pool_options` say otherwise) whose connections log into
    `log`, with the records and the test tables emptied and the log cleared."""
    options = {"min_size": 1, "max_size": 4, **pool_options}
    pool = await asyncpg.create_pool(dsn, init=log.attach, **options)
    try:
        await pool.execute(
            "DELETE FROM idem_requests; DELETE FROM test_accounts; DELETE FROM test_ledger"
        )
        log.queries.clear()
        yield pool
    finally:
        await pool.close()


def logged_store(dsn: str, log: QueryLog, **connect: Any) -> PostgresStore:
    """A store with a pool of its own, of one connection (whatever a request leaves on it, the
    next acquisition gets), whose messages are logged into `log`."""
    return PostgresStore(
        dsn=dsn,
        min_size=1,
        max_size=1,
        listen=False,
        connect_kwargs={"init": log.attach, **connect},
    )


class Probe:
    """Counts handler executions and lets a test hold a handler at a point."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.delay = 0.0
        #: The claim's connection the credit handler last wrote on.
        self.connection: Any = None


LEDGER_INSERT = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, $2, $3)"
BALANCE_UPSERT = (
    "INSERT INTO test_accounts (tenant, account_id, balance) VALUES ($1, $2, $3) "
    "ON CONFLICT (tenant, account_id) DO UPDATE "
    "SET balance = test_accounts.balance + EXCLUDED.balance RETURNING balance"
)


async def _write_credit(conn: Any, tenant: str, account: str, amount: int) -> int:
    await conn.execute(LEDGER_INSERT, tenant, account, amount)
    balance: int = await conn.fetchval(BALANCE_UPSERT, tenant, account, amount)
    return balance


async def credit(request: Request) -> Response:
    """A transactional business write: one ledger row and a balance change on the claim's tx.

    Unguarded (no claim: key optional and absent, kill switch, guard=False), it writes in its own
    transaction on `app.state.pool` when the app was built with one, so such runs are countable.
    """
    probe: Probe = request.app.state.probe
    probe.calls += 1
    payload = await request.json()
    account = request.path_params["account_id"]
    try:
        ctx = get_context(request)
    except LookupError:
        pool = request.app.state.pool
        if pool is None:
            raise
        ctx = None
        user = request.scope.get("user")
        tenant = user.display_name if user is not None and user.is_authenticated else ""
        async with pool.acquire() as conn, conn.transaction():
            balance = await _write_credit(conn, tenant, account, payload["amount"])
    else:
        if ctx.connection is not None:
            probe.connection = ctx.connection
            balance = await _write_credit(ctx.connection, ctx.tenant, account, payload["amount"])
        else:
            balance = payload["amount"]
    probe.entered.set()
    if probe.gate is not None:
        await probe.gate.wait()
    if probe.delay:
        await asyncio.sleep(probe.delay)
    mode = request.query_params.get("respond", "201")
    if mode == "raise":
        raise RuntimeError("handler failed after writing")
    if mode == "declare-final":
        assert ctx is not None
        ctx.declare(Outcome.FAILED_FINAL)
        return JSONResponse({"error": "declined"}, status_code=503)
    if mode == "declare-release":
        assert ctx is not None
        ctx.declare(Outcome.RELEASE)
    status = int(mode) if mode.isdigit() else 201
    headers = {"location": f"/accounts/{account}", "set-cookie": "s=1"}
    if request.query_params.get("headers") == "extra":
        # Per-response headers a server or framework may add; never part of a stored response.
        headers.update(
            {
                "date": "Tue, 01 Jul 2025 12:00:00 GMT",
                "server": "test-server",
                "cache-control": "no-store",
                "x-request-note": "kept",
            }
        )
    return JSONResponse(
        {
            "account_id": account,
            "amount": payload["amount"],
            "balance": balance,
            "call": probe.calls,
        },
        status_code=status,
        headers=headers,
    )


async def stream(request: Request) -> Response:
    probe: Probe = request.app.state.probe
    probe.calls += 1

    async def events() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream")


async def stream_write(request: Request) -> Response:
    """SSE that writes a ledger row (amount 1) before answering and another (amount 2) while
    streaming: only the first is inside the settled claim."""
    probe: Probe = request.app.state.probe
    probe.calls += 1
    ctx = get_context(request)
    await ctx.connection.execute(LEDGER_INSERT, ctx.tenant, "stream", 1)

    async def events() -> AsyncIterator[bytes]:
        yield b"data: before\n\n"
        await ctx.connection.execute(LEDGER_INSERT, ctx.tenant, "stream", 2)
        yield b"data: after\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def big(request: Request) -> Response:
    probe: Probe = request.app.state.probe
    probe.calls += 1
    size = int(request.query_params.get("size", "100"))

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(size // 1000):
            yield b"x" * 1000

    return StreamingResponse(chunks(), media_type="application/octet-stream")


async def items(request: Request) -> Response:
    probe: Probe = request.app.state.probe
    probe.calls += 1
    return JSONResponse({"item": "x", "call": probe.calls}, status_code=201)


async def read_account(request: Request) -> Response:
    probe: Probe = request.app.state.probe
    probe.calls += 1
    return JSONResponse({"ok": True})


async def stream_json(request: Request) -> Response:
    """A JSON document streamed in small pieces (not SSE): small enough to be stored whole."""
    probe: Probe = request.app.state.probe
    probe.calls += 1

    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b'{"a":', b" [1, 2", b", 3], ", b'"call": ', str(probe.calls).encode(), b"}"):
            yield piece

    return StreamingResponse(pieces(), status_code=201, media_type="application/json")


#: Not UTF-8, not JSON: a stored response must be kept and replayed byte for byte.
BINARY_BODY = bytes(range(256)) * 4


async def binary(request: Request) -> Response:
    probe: Probe = request.app.state.probe
    probe.calls += 1
    return Response(BINARY_BODY, status_code=201, media_type="application/octet-stream")


async def no_content(request: Request) -> Response:
    probe: Probe = request.app.state.probe
    probe.calls += 1
    return Response(status_code=204, headers={"x-done": "yes"})


@not_idempotent
async def search(request: Request) -> Response:
    """A POST that is a query, exempted with the decorator."""
    probe: Probe = request.app.state.probe
    probe.calls += 1
    return JSONResponse({"results": [], "call": probe.calls})


def build_app(
    store: Store,
    *,
    default_policy: Policy | None = None,
    policies: dict[str, Policy] | None = None,
    tenant_resolver: Callable[..., Any] | None = None,
    pool: Any = None,
    **middleware_options: Any,
) -> Starlette:
    """`pool` lets unguarded credits write (see `credit`); other options go to the middleware."""
    kwargs: dict[str, Any] = {"store": store, "default_policy": default_policy or Policy()}
    if policies:
        kwargs["policies"] = policies
    if tenant_resolver is not None:
        kwargs["tenant_resolver"] = tenant_resolver
    kwargs.update(middleware_options)
    app = Starlette(
        routes=[
            Route("/accounts/{account_id}/credits", credit, methods=["POST"]),
            Route("/accounts/{account_id}", read_account, methods=["GET", "PUT"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/stream-write", stream_write, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/items", items, methods=["POST"]),
            Route("/stream-json", stream_json, methods=["POST"]),
            Route("/binary", binary, methods=["POST"]),
            Route("/search", search, methods=["POST"]),
            Route("/no-content", no_content, methods=["POST"]),
            status_route(store),
            Mount("/v2", routes=[Route("/items/{item_id}", items, methods=["POST"])]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, **kwargs),
        ],
    )
    app.state.probe = Probe()
    app.state.pool = pool
    return app
