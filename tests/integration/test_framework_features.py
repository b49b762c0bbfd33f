"""Starlette and FastAPI features behind the middleware, on PostgreSQL: an app served under a
root path (a proxy's prefix, stripped or not), `redirect_slashes`' 307, dependencies with
`yield` (`Depends(scope="function" | "request")`) and the lifespan's state."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from starlette.responses import StreamingResponse

from idem_middleware.fastapi import IdempotencyConnection, install
from idem_middleware.store.postgres import PostgresStore
from tests.apps import records
from tests.apps.servers import uvicorn_serving

WRITE = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', $1)"


def _client(app: Any, root_path: str = "") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, root_path=root_path, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def _amounts(pool: asyncpg.Pool[Any]) -> list[int]:
    return [row["amount"] for row in await pool.fetch("SELECT amount FROM test_ledger ORDER BY 1")]


def _orders_app(store: PostgresStore) -> FastAPI:
    app = FastAPI()

    @app.post("/orders/{order_id}", status_code=201)
    async def order(order_id: str, conn: IdempotencyConnection) -> Any:
        await conn.execute(WRITE, 1)
        return {"order_id": order_id}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    return app


async def test_under_a_root_path_a_route_is_guarded_and_named_alike_with_or_without_the_prefix(
    pg_store, pool
):
    """A proxy's prefix (`--root-path /api`) in the path or stripped from it: the same route,
    guarded (a request without a key is refused), one operation named by its template."""
    async with _client(_orders_app(pg_store), root_path="/api") as c:
        unkeyed = await c.post("/api/orders/7", json={})
        prefixed = await c.post("/api/orders/7", json={}, headers={"Idempotency-Key": "k"})
        stripped = await c.post("/orders/7", json={}, headers={"Idempotency-Key": "k"})
    assert unkeyed.status_code == 400
    assert (prefixed.status_code, stripped.status_code) == (201, 201)
    assert stripped.headers["idempotent-replayed"] == "true"
    assert [(r["operation"], r["state"]) for r in await records(pool)] == [
        ("POST /orders/{order_id}", "succeeded")
    ]
    assert await _amounts(pool) == [1]


async def test_a_redirect_to_the_slashless_route_records_nothing_under_its_key(pg_store, pool):
    """`POST /orders/7/` is the router's 307 to `/orders/7`: not the operation, so nothing is
    claimed, and the key's request to `/orders/7` runs the handler."""
    async with _client(_orders_app(pg_store)) as c:
        redirect = await c.post("/orders/7/", json={}, headers={"Idempotency-Key": "k"})
        assert await records(pool) == []
        created = await c.post("/orders/7", json={}, headers={"Idempotency-Key": "k"})
    assert redirect.status_code == 307
    assert redirect.headers["location"] == "http://test/orders/7"
    assert created.status_code == 201
    assert "idempotent-replayed" not in created.headers
    assert await _amounts(pool) == [1]


def _yielding_app(store: PostgresStore, scope: str, fail: bool, stream: bool) -> FastAPI:
    app = FastAPI()
    app.state.teardowns = []

    async def ledger(conn: IdempotencyConnection) -> AsyncIterator[Any]:
        yield conn
        try:
            await conn.execute(WRITE, 100)
        except asyncpg.InterfaceError as exc:
            app.state.teardowns.append(str(exc))
        else:
            app.state.teardowns.append("wrote")
        if fail:
            raise RuntimeError("the teardown failed")

    @app.post("/items", status_code=201)
    async def create(conn: Any = Depends(ledger, scope=scope)) -> Any:  # noqa: B008
        await conn.execute(WRITE, 1)
        if not stream:
            return {"ok": True}

        async def events() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"

        return StreamingResponse(events(), status_code=201, media_type="text/event-stream")

    install(app, store=store, tenant_resolver=lambda s: "t")
    return app


@pytest.mark.parametrize("scope", ["function", "request"])
async def test_a_yield_dependencys_teardown_writes_in_the_claim(pg_store, pool, scope):
    """Either scope's teardown runs before the held response leaves: its write commits with it."""
    app = _yielding_app(pg_store, scope, fail=False, stream=False)
    async with _client(app) as c:
        first = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
        again = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert app.state.teardowns == ["wrote"]
    assert await _amounts(pool) == [1, 100]


@pytest.mark.parametrize("scope", ["function", "request"])
async def test_a_failing_teardown_rolls_the_claim_back_and_a_retry_runs_again(
    pg_store, pool, scope
):
    app = _yielding_app(pg_store, scope, fail=True, stream=False)
    async with _client(app) as c:
        first = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
        again = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
    assert (first.status_code, again.status_code) == (500, 500)
    assert app.state.teardowns == ["wrote", "wrote"]
    assert await records(pool) == []
    assert await _amounts(pool) == []


@pytest.mark.parametrize("fail", [False, True])
async def test_after_a_stream_a_request_scoped_teardown_cannot_write_in_the_settled_claim(
    pg_store, pool, fail
):
    """A stream settles its claim before its first byte: the teardown of a `scope="request"`
    dependency runs after that, and the claim's connection refuses its write (never another
    request's); its failure leaves the committed outcome as it is."""
    app = _yielding_app(pg_store, "request", fail=fail, stream=True)
    async with _client(app) as c:
        first = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
        again = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
    assert (first.status_code, first.text, again.status_code) == (201, "data: 1\n\n", 201)
    assert again.headers["idempotency-body-omitted"] == "streaming"
    assert app.state.teardowns == [
        "cannot call Connection.execute(): connection has been released back to the pool"
    ]
    assert [(r["state"], r["response_status"]) for r in await records(pool)] == [("succeeded", 201)]
    assert await _amounts(pool) == [1]


async def test_before_a_stream_a_function_scoped_teardown_writes_in_the_claim(pg_store, pool):
    app = _yielding_app(pg_store, "function", fail=False, stream=True)
    async with _client(app) as c:
        first = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
    assert first.status_code == 201
    assert app.state.teardowns == ["wrote"]
    assert await _amounts(pool) == [1, 100]


async def test_the_lifespans_state_reaches_the_tenant_resolver_and_the_handler(pg_store, pool):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        yield {"tenant": "from-lifespan"}

    app = FastAPI(lifespan=lifespan)

    @app.post("/items", status_code=201)
    async def create(request: Request, conn: IdempotencyConnection) -> Any:
        await conn.execute(WRITE, 1)
        return {"tenant": request.state.tenant}

    install(app, store=pg_store, tenant_resolver=lambda scope: scope["state"]["tenant"])
    async with (
        uvicorn_serving(app, "h11") as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c,
    ):
        first = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
        again = await c.post("/items", json={}, headers={"Idempotency-Key": "k"})
    assert (first.status_code, first.json()) == (201, {"tenant": "from-lifespan"})
    assert again.headers["idempotent-replayed"] == "true"
    assert [(r["tenant"], r["operation"]) for r in await records(pool)] == [
        ("from-lifespan", "POST /items")
    ]
