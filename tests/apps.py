"""Small apps the tests build for themselves (no shared mutable app)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from idem_middleware import IdempotencyMiddleware, Outcome, Policy, get_context, not_idempotent
from idem_middleware.status import status_route
from idem_middleware.store.base import Store

TOKENS = {"demo-a": "tenant-a", "demo-b": "tenant-b"}


class BearerBackend(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        header = conn.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        tenant = TOKENS.get(token) if scheme.lower() == "bearer" else None
        if tenant is None:
            return None
        return AuthCredentials(["authenticated"]), SimpleUser(tenant)


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
        await pool.execute("TRUNCATE idem_requests, test_accounts, test_ledger")
        log.queries.clear()
        yield pool
    finally:
        await pool.close()


class Probe:
    """Counts handler executions and lets a test hold a handler at a point."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.delay = 0.0
        #: The claim's connection the credit handler last wrote on.
        self.connection: Any = None


_LEDGER_INSERT = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, $2, $3)"
_BALANCE_UPSERT = (
    "INSERT INTO test_accounts (tenant, account_id, balance) VALUES ($1, $2, $3) "
    "ON CONFLICT (tenant, account_id) DO UPDATE "
    "SET balance = test_accounts.balance + EXCLUDED.balance RETURNING balance"
)


async def _write_credit(conn: Any, tenant: str, account: str, amount: int) -> int:
    await conn.execute(_LEDGER_INSERT, tenant, account, amount)
    balance: int = await conn.fetchval(_BALANCE_UPSERT, tenant, account, amount)
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
    await ctx.connection.execute(_LEDGER_INSERT, ctx.tenant, "stream", 1)

    async def events() -> AsyncIterator[bytes]:
        yield b"data: before\n\n"
        await ctx.connection.execute(_LEDGER_INSERT, ctx.tenant, "stream", 2)
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


def client(app: Starlette, token: str | None = "demo-a") -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://test",
        headers=headers,
    )


# -- helpers shared by the HTTP tests ----------------------------------------------------------

PROBLEM_BASE = "urn:idem-middleware:problem:"


def key(value: str | bytes) -> dict[str, str | bytes]:
    return {"idempotency-key": value}


def assert_problem(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    """A problem+json refusal of one kind; returns the parsed problem."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = response.json()
    assert problem["type"] == PROBLEM_BASE + kind
    assert problem["status"] == status
    assert "idempotent-replayed" not in response.headers
    return problem


def assert_replay_of(replay: httpx.Response, original: httpx.Response) -> None:
    """The same status and body as the original, marked as a replay; the original is not."""
    assert "idempotent-replayed" not in original.headers
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.status_code == original.status_code
    assert replay.content == original.content
    assert replay.headers["content-length"] == str(len(replay.content))


async def count(pool: Any, table: str) -> int:
    assert table in {"test_ledger", "test_accounts", "idem_requests"}
    n: int = await pool.fetchval(f"SELECT count(*) FROM {table}")
    return n


async def balance(pool: Any, account: str, tenant: str = "tenant-a") -> int | None:
    value: int | None = await pool.fetchval(
        "SELECT balance FROM test_accounts WHERE tenant = $1 AND account_id = $2", tenant, account
    )
    return value


async def records(pool: Any) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        "SELECT tenant, operation, idem_key, state, mode, generation, response_status, "
        "response_headers, response_body, body_omitted, expires_at FROM idem_requests "
        "ORDER BY tenant, operation, idem_key"
    )
    return [dict(row) for row in rows]


#: The bound on every wait in the HTTP tests: long enough never to flake, short enough to fail fast.
BOUND = 5.0


async def wait_for_lock_waiters(pool: Any, n: int = 1) -> None:
    """Until `n` backends of this database are blocked on a lock (a duplicate on a claim)."""

    async def poll() -> None:
        while True:
            waiting = await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if waiting >= n:
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), BOUND)


def idempotency_middleware(app: Any) -> IdempotencyMiddleware:
    """The IdempotencyMiddleware in a Starlette app's stack (built by its first request)."""
    layer = app.middleware_stack
    for _ in range(20):
        if isinstance(layer, IdempotencyMiddleware):
            return layer
        layer = getattr(layer, "app", None)
    raise LookupError("no IdempotencyMiddleware in this app's stack")


async def wait_for_waiters(app: Any, n: int = 1) -> None:
    """Until `n` duplicates wait in the app's middleware for a key another request holds (they
    wait in the process, holding no connection: see idem_middleware/transactional.py)."""

    for _ in range(int(BOUND / 0.01)):
        if idempotency_middleware(app).waiters.count >= n:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"fewer than {n} duplicates waited")


async def wait_entered(probe: Probe) -> None:
    await asyncio.wait_for(probe.entered.wait(), BOUND)


class CountingStore:
    """Wraps a store and counts what the middleware asks of it (to prove a pass-through)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.calls = 0

    def transaction(self, *, acquire_timeout: float) -> Any:
        self.calls += 1
        return self.inner.transaction(acquire_timeout=acquire_timeout)

    async def get(self, key: Any) -> Any:
        self.calls += 1
        return await self.inner.get(key)


async def cancel_while_held(c: httpx.AsyncClient, probe: Probe, url: str, **kwargs: Any) -> None:
    """Start a request, hold its handler inside the claim, and cancel the request from outside.

    Returns once the cancelled task has finished, having checked it ended in CancelledError and
    nothing else; the probe is left ready for a retry (no gate).
    """
    async with Held(probe) as held:
        task = held.start(c.post(url, **kwargs))
        await wait_entered(probe)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=BOUND)
        assert task in done, "the cancelled request did not finish"
        assert task.cancelled(), f"expected only CancelledError, got {task.exception()!r}"
    probe.entered.clear()


def asgi_request(path: str, idem_key: str, content_length: int) -> dict[str, Any]:
    """A scope for driving an app directly: an authenticated (tenant-a) JSON POST."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"authorization", b"Bearer demo-a"),
            (b"idempotency-key", idem_key.encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(content_length).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }


class Held:
    """Requests run in the background while `probe.gate` holds the handler.

    `async with Held(probe) as held:` closes the gate; `held.start(coro)` runs a request as a
    task; `await held.release()` opens the gate. On exit the gate is opened whatever happened and
    every task is finished (cancelled after BOUND), so a failing test never leaves a claim open
    and a pool that cannot close.
    """

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.tasks: list[asyncio.Task[Any]] = []

    async def __aenter__(self) -> Held:
        self.probe.gate = asyncio.Event()
        return self

    def start(self, request: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(request)
        self.tasks.append(task)
        return task

    def release(self) -> None:
        assert self.probe.gate is not None
        self.probe.gate.set()

    async def __aexit__(self, *exc: object) -> None:
        if self.probe.gate is not None:
            self.probe.gate.set()
        pending = {t for t in self.tasks if not t.done()}
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=BOUND)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=BOUND)
        for task in self.tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a failure is the test's to report, not asyncio's
        self.probe.gate = None


async def idle_in_transaction(pool: Any) -> int:
    """Backends of this database left inside an open transaction (a leaked claim would be one)."""
    n: int = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND state LIKE 'idle in transaction%'"
    )
    return n


# ==============================================================================================
# Lease mode (tests/integration/test_lease_mode.py, tests/lease_app.py). Nothing above uses this.
#
# The "downstream system" is a table written in autocommit on its own connection: a bank outside
# our transaction that deduplicates by the downstream key (`ON CONFLICT (dkey) DO NOTHING`).
# ==============================================================================================

# Imports of this section live here (not at the top) so it stays self-contained.
import contextlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from idem_middleware import IdempotencyContext, Mode, StaleGeneration  # noqa: E402
from idem_middleware.reconcile import (  # noqa: E402
    Happened,
    NotHappened,
    ReconcileContext,
    Reconciler,
    Reconciliation,
)

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
    await pool.execute("TRUNCATE test_downstream, test_lease_calls")


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
    #: Raise DownstreamError "before" or "after" the downstream effect.
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
    await conn.execute(_LEDGER_INSERT, ctx.tenant, account, amount)


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
        routes=[Route(PAYOUTS, payout, methods=["POST"])],
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
