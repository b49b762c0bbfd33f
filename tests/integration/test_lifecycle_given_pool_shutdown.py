"""A deploy of an app whose store was given the app's own pool (`PostgresStore(pool=...)`), which
the app's lifespan closes at its shutdown, behind a real uvicorn whose graceful timeout cuts a
lease-mode request short.

Found by probing: uvicorn cancels the request and runs the lifespan shutdown at once; the app's
`pool.close()` came before the cancelled execution's `unknown` mark, which failed ("could not
mark its record unknown"): the record stayed `pending` under its live lease, every retry was
answered `409 request-in-flight` until the lease lapsed, and a `LeaseExpiry.TAKEOVER` retry then
ran the handler again. (A store of its own pool waits for those marks in its `close`; a given
pool is the app's to close.) The middleware now lets them settle before the app's shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from idem_middleware.policy import LeaseExpiry
from tests.apps import PROBLEM_BASE
from tests.apps.servers import port_of, uvicorn_in_loop
from tests.integration.test_startup_checks import startup

BOUND = 20.0
POLICY = Policy(
    mode=Mode.LEASE, lease_seconds=60, wait_seconds=1, on_lease_expiry=LeaseExpiry.TAKEOVER
)


def _app(
    store: PostgresStore, pool: asyncpg.Pool[Any], runs: list[str], entered: asyncio.Event
) -> Starlette:
    async def payout(request: Request) -> Response:
        ctx = get_context(request)
        runs.append(ctx.key)
        await ctx.fenced_connection()
        entered.set()
        await asyncio.sleep(BOUND * 3)  # (cut short by the server's graceful timeout)
        return JSONResponse({"paid": True}, status_code=201)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await pool.close()  # the app's pool, closed by the app

    return Starlette(
        routes=[Route("/payouts", payout, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                tenant_resolver=lambda scope: "tenant-a",
                policies={"POST /payouts": POLICY},
            )
        ],
        lifespan=lifespan,
    )


async def test_a_lease_request_cut_short_is_unknown_before_the_app_closes_its_pool(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    key = "given-pool-cut"
    runs: list[str] = []
    entered = asyncio.Event()
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=4)
    await pool.execute("DELETE FROM idem_requests WHERE idem_key = $1", key)
    app = _app(PostgresStore(pool=pool), pool, runs, entered)  # (never opened: the app's pool)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="critical", timeout_graceful_shutdown=1
    )
    async with uvicorn_in_loop(config, BOUND) as server:
        url = f"http://127.0.0.1:{port_of(server)}"
        async with httpx.AsyncClient(base_url=url) as client:
            headers = {"idempotency-key": key}
            answer = asyncio.ensure_future(client.post("/payouts", json={"a": 1}, headers=headers))
            await asyncio.wait_for(entered.wait(), BOUND)
            server.should_exit = True  # what SIGTERM does
            cut = await asyncio.wait_for(answer, BOUND)
    assert (cut.status_code, cut.json()["type"]) == (503, PROBLEM_BASE + "request-cancelled")
    assert pool.is_closing()

    # The record is `unknown` at once (it stayed `pending` under its 60 s lease), and the
    # restarted app's retry is told so; the handler never runs again.
    restarted = await asyncpg.create_pool(db_dsn, min_size=1, max_size=4)
    try:
        state = await restarted.fetchval("SELECT state FROM idem_requests WHERE idem_key = $1", key)
        store = PostgresStore(pool=restarted)
        transport = httpx.ASGITransport(app=_app(store, restarted, runs, asyncio.Event()))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                headers = {"idempotency-key": key}
                retry = await client.post("/payouts", json={"a": 1}, headers=headers)
        finally:
            await store.close()  # (its own connections: no lifespan closed them)
    finally:
        await restarted.close()
    assert state == "unknown"
    assert (retry.status_code, retry.json()["type"]) == (409, PROBLEM_BASE + "outcome-unknown")
    assert runs == [key]
    assert not [r for r in caplog.records if "could not mark" in r.getMessage()]


async def test_a_failed_settling_is_logged_and_the_apps_own_shutdown_still_runs(
    db_dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settling before the app's shutdown never raises: raised into the app's lifespan, it
    skipped the app's own shutdown (its pool, its clients) and failed the server's."""
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)

    async def broken() -> None:
        raise RuntimeError("the pool went first")

    monkeypatch.setattr(store, "let_cancelled_unwind", broken)
    shut: list[int] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with store:
            yield
        shut.append(1)

    app = Starlette(
        routes=[],
        middleware=[
            Middleware(IdempotencyMiddleware, store=store, tenant_resolver=lambda scope: "t")
        ],
        lifespan=lifespan,
    )
    caplog.set_level(logging.WARNING, "idem_middleware")
    sent = await startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert shut == [1]
    assert any("did not settle" in r.getMessage() for r in caplog.records)
