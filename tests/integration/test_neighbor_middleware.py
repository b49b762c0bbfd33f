"""The middleware a real app puts around and inside the idempotency middleware, on the real
store: `BaseHTTPMiddleware` (FastAPI's `@app.middleware("http")`) on either side, a rate limiter
inside it, a WSGI app behind a route. What docs/configuration.md says of each."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import httpx
import pytest
from a2wsgi import WSGIMiddleware
from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy, PostgresStore
from idem_middleware.fastapi import Idempotency, IdempotencyConnection, install
from tests.apps.checks import count, key, records
from tests.apps.concurrency import BOUND
from tests.apps.servers import uvicorn_serving

pytestmark = pytest.mark.asyncio


class Credit(BaseModel):
    amount: int


def fastapi_app(store: PostgresStore, order: str, runs: list[int]) -> FastAPI:
    """A credit written on the claim's connection, with an `@app.middleware("http")` that reads
    the body (as a logging middleware does) and adds a header, `order` of the idempotency
    middleware: "outside" it, "inside" it, or "both"."""
    app = FastAPI()

    @app.post("/credits", status_code=201)
    async def credit(
        body: Credit, conn: IdempotencyConnection, idem: Idempotency
    ) -> dict[str, int]:
        runs.append(body.amount)
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, 'a', $2)",
            idem.tenant,
            body.amount,
        )
        if body.amount < 0:
            raise RuntimeError("refused after writing")
        return {"credited": body.amount}

    async def logging_middleware(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        seen = len(await request.body())
        response = await call_next(request)
        response.headers["x-body-bytes"] = str(seen)
        return response

    if order in ("inside", "both"):
        app.middleware("http")(logging_middleware)
    install(app, store=store, tenant_resolver=lambda scope: "t")  # added last: runs first
    if order in ("outside", "both"):
        app.middleware("http")(logging_middleware)
    return app


@pytest.mark.parametrize("order", ["outside", "inside", "both"])
async def test_base_http_middleware_on_either_side_claims_replays_and_releases(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any], order: str
) -> None:
    runs: list[int] = []
    app = fastapi_app(pg_store, order, runs)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first, retry = [
            await client.post("/credits", headers=key("k1"), json={"amount": 5}) for _ in range(2)
        ]
        reused = await client.post("/credits", headers=key("k1"), json={"amount": 6})
        failed = [
            await client.post("/credits", headers=key("k2"), json={"amount": -1}) for _ in range(2)
        ]
    assert (first.status_code, first.json()) == (201, {"credited": 5})
    assert first.headers["x-body-bytes"] == "12"
    assert retry.headers["idempotent-replayed"] == "true"
    assert (retry.json(), retry.headers["x-body-bytes"]) == (first.json(), "12")
    assert reused.status_code == 422
    # The handler's exception rolls its write back and releases the key: its retry runs again.
    assert [r.status_code for r in failed] == [500, 500]
    assert runs == [5, -1, -1]
    assert await count(pool, "test_ledger") == 1
    assert [r["idem_key"] for r in await records(pool)] == ["k1"]


class Limiter:
    """A rate limiter: the first `allowed` requests pass, the others get a 429."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.allowed = 1
        self.passed = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.passed >= self.allowed:
            await JSONResponse({"error": "slow down"}, 429)(scope, receive, send)
            return
        self.passed += 1
        await self.app(scope, receive, send)


async def test_a_rate_limiters_429_inside_ours_releases_the_key() -> None:
    runs: list[None] = []

    async def pay(request: Request) -> JSONResponse:
        await request.body()
        runs.append(None)
        return JSONResponse({"n": len(runs)}, status_code=201)

    limiters: list[Limiter] = []

    def limiter(app: ASGIApp) -> Limiter:
        limiters.append(Limiter(app))
        return limiters[-1]

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t"),
            Middleware(limiter),
        ],
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        assert (await client.post("/pay", headers=key("a"), content=b"{}")).status_code == 201
        limited = await client.post("/pay", headers=key("b"), content=b"{}")
        # A replay does not count against the limit: it never reaches the limiter.
        replay = await client.post("/pay", headers=key("a"), content=b"{}")
        limiters[0].allowed = 2
        retried = await client.post("/pay", headers=key("b"), content=b"{}")
    assert limited.status_code == 429
    assert replay.headers["idempotent-replayed"] == "true"
    # The 429 stored nothing: once the limit allows it, the retry runs the handler, once.
    assert (retried.status_code, retried.json()) == (201, {"n": 2})
    assert "idempotent-replayed" not in retried.headers
    assert len(runs) == 2


def legacy(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    environ["wsgi.input"].read()
    legacy.calls += 1  # type: ignore[attr-defined]
    start_response("201 Created", [("Content-Type", "text/plain")])
    return [b"done %d" % legacy.calls]  # type: ignore[attr-defined]


async def test_a_wsgi_app_behind_a_route_is_guarded() -> None:
    legacy.calls = 0  # type: ignore[attr-defined]
    app = Starlette(
        routes=[Route("/legacy/pay", WSGIMiddleware(legacy), methods=["POST"])],  # type: ignore[arg-type]
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t")
        ],
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        first, retry = [
            await client.post("/legacy/pay", headers=key("k"), content=b"x") for _ in range(2)
        ]
    assert (first.status_code, first.text) == (201, "done 1")
    assert (retry.text, retry.headers["idempotent-replayed"]) == ("done 1", "true")
    assert legacy.calls == 1  # type: ignore[attr-defined]


class TimeLimit:
    """A pure-ASGI timeout: it cancels the app past `seconds` and answers 504 itself."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds
        self.raised: list[BaseException] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await asyncio.wait_for(self.app(scope, receive, send), self.seconds)
        except TimeoutError:
            try:
                await JSONResponse({"detail": "timed out"}, 504)(scope, receive, send)
            except Exception as exc:  # (what the server would log as an error)
                self.raised.append(exc)


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_timeout_middleware_outside_ours_answers_the_request_it_cancels(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode
) -> None:
    """Found by probing: the middleware answered the request the timeout cancelled `503
    request-cancelled` ("the server is shutting down"), which reached the client in place of
    the timeout's 504; the timeout's own answer then came second, and the server refused it
    (uvicorn: "Unexpected ASGI message 'http.response.start'", an error logged for every
    request timed out). With a middleware before ours that may answer, ours leaves it to it."""
    runs: list[None] = []

    async def slow(request: Request) -> JSONResponse:
        await request.body()
        runs.append(None)
        await asyncio.sleep(BOUND)  # cut short by the time limit
        return JSONResponse({}, 201)

    limits: list[TimeLimit] = []

    def time_limit(app: ASGIApp) -> TimeLimit:
        limits.append(TimeLimit(app, 0.2))
        return limits[-1]

    app = Starlette(
        routes=[Route("/pay", slow, methods=["POST"])],
        middleware=[
            Middleware(time_limit),
            Middleware(
                IdempotencyMiddleware,
                store=pg_store,
                tenant_resolver=lambda s: "t",
                default_policy=Policy(mode=mode),
            ),
        ],
    )
    async with (
        uvicorn_serving(app, "h11") as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        answers = [await client.post("/pay", headers=key("k"), content=b"{}") for _ in range(2)]
    assert limits[0].raised == []
    assert (answers[0].status_code, answers[0].json()) == (504, {"detail": "timed out"})
    if mode is Mode.TRANSACTIONAL:  # rolled back, the key free: the retry runs, and is cut short
        assert (answers[1].status_code, len(runs)) == (504, 2)
        assert await records(pool) == []
    else:  # the lease-mode record is `unknown`: its downstream call may have been made
        assert answers[1].status_code == 409
        assert answers[1].json()["type"].endswith("outcome-unknown")
        assert [r["state"] for r in await records(pool)] == ["unknown"]
        assert len(runs) == 1
