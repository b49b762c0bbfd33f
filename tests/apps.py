"""Small apps the tests build for themselves (no shared mutable app)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from idem_middleware import IdempotencyMiddleware, Outcome, Policy, get_context, not_idempotent
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


class Probe:
    """Counts handler executions and lets a test hold a handler at a point."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.delay = 0.0


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
            Route("/big", big, methods=["POST"]),
            Route("/items", items, methods=["POST"]),
            Route("/stream-json", stream_json, methods=["POST"]),
            Route("/binary", binary, methods=["POST"]),
            Route("/search", search, methods=["POST"]),
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


async def wait_entered(probe: Probe) -> None:
    await asyncio.wait_for(probe.entered.wait(), BOUND)
