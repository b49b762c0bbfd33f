"""A deploy: the server shuts down while requests are in flight, and the store closes.

uvicorn (in this loop, as its worker processes run it) with a graceful-shutdown timeout shorter
than a handler: it cancels the requests still running, then runs the app's lifespan shutdown (the
store's `close`) at once, without waiting for the cancelled requests to unwind. And `close` itself
when the database stops answering mid-shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import (
    IdempotencyMiddleware,
    Mode,
    Policy,
    PostgresStore,
    RecordKey,
    get_context,
    store_lifespan,
)
from idem_middleware.store.postgres import closing, listener
from tests.apps import PROBLEM_BASE, wait_for_waiters
from tests.apps.servers import port_of, uvicorn_in_loop

BOUND = 20.0
HANDLER_SECONDS = 60.0  # longer than any test: the server's shutdown cuts it short
LEASE = Policy(mode=Mode.LEASE, lease_seconds=60, wait_seconds=1)


class Passing(BaseHTTPMiddleware):
    """An `@app.middleware("http")` (logging, a request id): it runs the rest of the app in an
    anyio task group, whose cancel scope cancels every await of a cancelled request until its
    task ends, the middleware's cleanup too."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        return await call_next(request)


def _lease_app(
    store: PostgresStore, runs: list[str], entered: asyncio.Event, n: int, *, outer: bool = False
) -> Starlette:
    async def payout(request: Request) -> Response:
        ctx = get_context(request)
        runs.append(ctx.key)
        await ctx.fenced_connection()  # (its rollback is the executor's first step out)
        if len(runs) >= n:
            entered.set()
        await asyncio.sleep(HANDLER_SECONDS)
        return JSONResponse({"paid": True}, status_code=201)

    return Starlette(
        routes=[Route("/payouts", payout, methods=["POST"])],
        middleware=[
            *([Middleware(Passing)] if outer else []),
            Middleware(
                IdempotencyMiddleware,
                store=store,
                tenant_resolver=lambda scope: "tenant-a",
                policies={"POST /payouts": LEASE},
            ),
        ],
        lifespan=store_lifespan(store),
    )


@contextlib.asynccontextmanager
async def serving(app: Any, *, graceful: int) -> AsyncIterator[tuple[uvicorn.Server, str]]:
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="critical", timeout_graceful_shutdown=graceful
    )
    async with uvicorn_in_loop(config, BOUND) as server:
        yield server, f"http://127.0.0.1:{port_of(server)}"


@pytest.mark.parametrize("outer", [False, True], ids=["alone", "base-http-middleware-outside"])
async def test_lease_requests_cut_short_by_a_graceful_timeout_are_left_unknown(
    db_dsn: str, pool: Any, outer: bool
) -> None:
    """The cancelled executions mark their records `unknown` on their way out (their effects
    may have happened), so a retry gets `outcome-unknown` (or its reconciler) at once. Before,
    the store's close, run by the server right after cancelling them, took the pool away first:
    their settlements failed ("the store is closed"), and the records stayed `pending` under a
    live lease, every retry answered 409 request-in-flight until the lease lapsed. Behind a
    `BaseHTTPMiddleware`, the same: its cancel scope cancelled the settlement itself, silently."""
    keys = ["cut-1", "cut-2", "cut-3"]
    runs: list[str] = []
    entered = asyncio.Event()
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=5)
    app = _lease_app(store, runs, entered, len(keys), outer=outer)
    async with serving(app, graceful=1) as (server, url), httpx.AsyncClient(base_url=url) as c:

        async def pay(key: str) -> int | str:
            try:
                r = await c.post("/payouts", json={"amount": 5}, headers={"idempotency-key": key})
            except httpx.TransportError as exc:
                return type(exc).__name__
            return r.status_code

        answers = [asyncio.ensure_future(pay(key)) for key in keys]
        await asyncio.wait_for(entered.wait(), BOUND)
        server.should_exit = True  # what SIGTERM does
        await asyncio.wait_for(asyncio.gather(*answers), BOUND)
    assert sorted(runs) == keys
    rows = await pool.fetch(
        "SELECT idem_key, state FROM idem_requests WHERE idem_key = ANY($1) ORDER BY idem_key",
        keys,
    )
    assert [(r["idem_key"], r["state"]) for r in rows] == [(key, "unknown") for key in keys]

    # The restarted server: the retry is told the outcome is unknown; nothing runs again.
    restarted = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    async with restarted:
        app = _lease_app(restarted, runs, asyncio.Event(), len(keys) + 1)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            retry = await c.post(
                "/payouts", json={"amount": 5}, headers={"idempotency-key": keys[0]}
            )
    assert (retry.status_code, retry.json()["type"]) == (409, PROBLEM_BASE + "outcome-unknown")
    assert sorted(runs) == keys


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE], ids=lambda m: m.value)
async def test_requests_cut_short_by_a_graceful_timeout_are_told_to_retry(
    db_dsn: str, pool: Any, mode: Mode
) -> None:
    """The original and a duplicate waiting in the process for it, both cancelled by the
    server's graceful timeout: each is answered `503 request-cancelled` + Retry-After (uvicorn's
    plain-text 500 before), and nothing is left claimed: the transactional claim rolled back,
    the lease-mode record is `unknown`, the waiter's registration is gone."""
    key = f"cut-waiter-{mode.value}"
    # (Registrations other tests left behind, in a run that ordered them first.)
    waiters_before = await pool.fetchval("SELECT count(*) FROM idem_waiters")
    runs: list[str] = []
    entered = asyncio.Event()
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=5)
    policy = Policy(mode=mode, lease_seconds=60, wait_seconds=BOUND * 2)

    async def pay(request: Request) -> Response:
        runs.append(get_context(request).key)
        entered.set()
        await asyncio.sleep(HANDLER_SECONDS)
        return JSONResponse({"paid": True}, status_code=201)

    app = Starlette(
        routes=[Route("/payouts", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                tenant_resolver=lambda scope: "tenant-a",
                policies={"POST /payouts": policy},
            )
        ],
        lifespan=store_lifespan(store),
    )
    async with serving(app, graceful=1) as (server, url), httpx.AsyncClient(base_url=url) as c:

        def post() -> Any:
            return c.post("/payouts", json={"amount": 5}, headers={"idempotency-key": key})

        original = asyncio.ensure_future(post())
        await asyncio.wait_for(entered.wait(), BOUND)
        duplicate = asyncio.ensure_future(post())
        await wait_for_waiters(app)
        server.should_exit = True  # what SIGTERM does
        answers = await asyncio.wait_for(asyncio.gather(original, duplicate), BOUND)
    for r in answers:
        assert (r.status_code, r.headers["content-type"]) == (503, "application/problem+json")
        assert r.json()["type"] == PROBLEM_BASE + "request-cancelled"
        assert r.headers["retry-after"] == "1"
    assert runs == [key]
    states = await pool.fetch("SELECT state FROM idem_requests WHERE idem_key = $1", key)
    assert [r["state"] for r in states] == ([] if mode is Mode.TRANSACTIONAL else ["unknown"])
    assert await pool.fetchval("SELECT count(*) FROM idem_waiters") == waiters_before


# -- a database that stops answering --------------------------------------------------------


class Freezer:
    """A loopback TCP relay to the test database that can stop relaying (`freeze`): its
    connections stay open and nothing more comes back, as from a server that hangs or a
    network that drops every packet."""

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        host = parse_qs(parts.query).get("host", [parts.hostname or "localhost"])[0]
        self._port = parts.port or 5432
        self._unix = f"{host}/.s.PGSQL.{self._port}" if host.startswith("/") else None
        self._host = host
        self._dsn = parts
        self._frozen = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    def dsn(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        user = self._dsn.username or "postgres"
        password = f":{self._dsn.password}" if self._dsn.password else ""
        netloc = f"{user}{password}@127.0.0.1:{port}"
        return urlunsplit(("postgresql", netloc, self._dsn.path, "", ""))

    def freeze(self) -> None:
        self._frozen.set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if self._frozen.is_set():
                    await asyncio.sleep(BOUND * 3)  # (cut short when the test ends)
                    return
                writer.write(data)
                await writer.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._unix is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(self._unix)
        else:
            up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        pipes = [
            asyncio.ensure_future(self._pipe(reader, up_writer)),
            asyncio.ensure_future(self._pipe(up_reader, writer)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            writer.close()
            up_writer.close()

    def _spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.asynccontextmanager
    async def relaying(self) -> AsyncIterator[str]:
        self.server = await asyncio.start_server(self._spawn, "127.0.0.1", 0)
        try:
            yield self.dsn()
        finally:
            self.server.close()
            for task in tuple(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def test_close_is_bounded_when_the_database_stops_answering(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deploy during a database outage: the store's close says goodbye on each connection
    and waited for the server's answer for ever (asyncpg's close has no timeout), so the
    process never exited until it was killed. Now it cuts the connections after its bound."""
    monkeypatch.setattr(closing, "CLOSE_SECONDS", 1.0)
    monkeypatch.setattr(listener, "CONNECT_SECONDS", 1.0)
    freezer = Freezer(db_dsn)
    async with freezer.relaying() as dsn:
        store = PostgresStore(dsn=dsn, min_size=2, max_size=2)
        await store.open()
        key = RecordKey("tenant-a", "POST /payouts", "frozen")
        assert await store.get(key) is None
        async with store.watch(key) as watch:  # the LISTEN connection comes up
            await watch.wait(0.5)
        for _ in range(200):
            if store._listener.connected():
                break
            await asyncio.sleep(0.01)
        assert store._listener.connected()
        freezer.freeze()
        await asyncio.wait_for(store.close(), BOUND)
        assert not store.is_open


@pytest.mark.parametrize(
    ("mode", "fast_path"),
    [(Mode.TRANSACTIONAL, True), (Mode.TRANSACTIONAL, False), (Mode.LEASE, True)],
    ids=["transactional-fast", "transactional-ordinary", "lease"],
)
async def test_a_claim_is_a_503_when_the_database_stops_answering(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch, mode: Mode, fast_path: bool
) -> None:
    """Found by probing (the server's processes stopped with SIGSTOP): a fresh request's claim
    waited for the server as long as it was stopped. Its BEGIN and its draw of generations (the
    fast path's first claim after an idle second; every ordinary claim's BEGIN) had no bound,
    nor had a lease-mode claim. Each is bounded now: the claim's wait (transactional), twice
    the store's checkout bound (lease); a 503, nothing run."""
    from idem_middleware.store.postgres.generations import Generations

    monkeypatch.setattr(closing, "CLOSE_SECONDS", 1.0)
    monkeypatch.setattr(Generations, "take_ready", lambda self: None)  # (a draw, every claim)
    ran: list[int] = []

    async def pay(request: Request) -> Response:
        ran.append(1)
        return JSONResponse({}, status_code=201)

    freezer = Freezer(db_dsn)
    async with freezer.relaying() as dsn:
        store = PostgresStore(dsn=dsn, min_size=1, max_size=1, listen=False, fast_path=fast_path)
        await store.open()
        app = Starlette(
            routes=[Route("/pay", pay, methods=["POST"])],
            middleware=[
                Middleware(
                    IdempotencyMiddleware,
                    store=store,
                    tenant_resolver=lambda scope: "tenant-a",
                    default_policy=Policy(mode=mode, wait_seconds=0.5),
                    acquire_timeout=0.5,
                )
            ],
        )
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            keys = [f"{name}-{mode}-{fast_path}" for name in ("warm", "frozen")]
            warm = await c.post("/pay", json={}, headers={"idempotency-key": keys[0]})
            assert warm.status_code == 201, warm.text
            freezer.freeze()
            frozen = await asyncio.wait_for(
                c.post("/pay", json={}, headers={"idempotency-key": keys[1]}), BOUND
            )
        await asyncio.wait_for(store.close(), BOUND)
    assert frozen.status_code == 503, frozen.text
    assert frozen.headers["content-type"] == "application/problem+json"
    assert ran == [1]  # the warm request's alone
