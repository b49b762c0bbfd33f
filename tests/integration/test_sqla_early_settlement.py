"""A ClaimSession's pending writes and a response that cannot be held (a stream, or one over the
size cap): the outcome is settled before the first byte, while FastAPI ends a dependency (and so
commits its session) only after the response was sent. What the handler added to the session
without flushing must commit with the outcome (before: it was lost, and the record said the
request succeeded), and a flush that fails there must fail the request."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from idem_middleware import Mode, idempotent
from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "test_sqla_orders"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    tenant: Mapped[str]
    amount: Mapped[int]


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS test_sqla_orders (id text PRIMARY KEY, tenant text NOT NULL, "
        "amount bigint NOT NULL, meta json)"
    )
    await pool.execute("TRUNCATE test_sqla_orders")
    async with PostgresStore(pool=pool) as store:
        yield store


def app(store: PostgresStore, mode: Mode) -> FastAPI:
    api = FastAPI()

    @api.post("/events/{order_id}")
    @idempotent(mode=mode)
    async def events(order_id: str, session: ClaimSession) -> StreamingResponse:
        session.add(Order(id=order_id, tenant="t", amount=1))  # no flush: the session's end does

        async def stream() -> AsyncIterator[bytes]:
            yield b"data: placed\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @api.post("/export/{order_id}")
    @idempotent(mode=mode)
    async def export(order_id: str, session: ClaimSession) -> dict[str, str]:
        session.add(Order(id=order_id, tenant="t", amount=1))
        return {"report": "x" * (1024 * 1024 + 1)}  # over max_response_bytes: streamed through

    install(api, store=store, tenant_resolver=lambda scope: "t")
    return api


def client(api: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api, raise_app_exceptions=False),
        base_url="http://test",
    )


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize(("path", "omitted"), [("events", "streaming"), ("export", "too-large")])
async def test_pending_session_writes_commit_with_an_early_outcome(
    store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode, path: str, omitted: str
) -> None:
    async with client(app(store, mode)) as http:
        headers = {"Idempotency-Key": f"{path}-1"}
        first = await http.post(f"/{path}/o1", headers=headers)
        again = await http.post(f"/{path}/o1", headers=headers)
    assert first.status_code == 200, first.text
    assert again.headers["idempotent-replayed"] == "true"
    record = await pool.fetchrow("SELECT state, body_omitted FROM idem_requests")
    assert record is not None
    assert (record["state"], record["body_omitted"]) == ("succeeded", omitted)
    assert await pool.fetchval("SELECT array_agg(id) FROM test_sqla_orders") == ["o1"]


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("path", ["events", "export"])
async def test_a_pending_write_that_fails_before_the_first_byte_fails_the_request(
    store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode, path: str
) -> None:
    await pool.execute("INSERT INTO test_sqla_orders (id, tenant, amount) VALUES ('o2', 't', 9)")
    async with client(app(store, mode)) as http:
        response = await http.post(f"/{path}/o2", headers={"Idempotency-Key": f"{path}-2"})
    # The duplicate primary key is found before anything was sent: a plain failure, not a 200
    # whose effect is missing.
    assert response.status_code == 500
    states = [r["state"] for r in await pool.fetch("SELECT state FROM idem_requests")]
    assert states == ([] if mode is Mode.TRANSACTIONAL else ["unknown"])
    assert await pool.fetchval("SELECT amount FROM test_sqla_orders WHERE id = 'o2'") == 9


@pytest.mark.parametrize("path", ["events", "export"])
async def test_a_flush_that_failed_and_was_caught_fails_an_early_outcome_too(
    store: PostgresStore, pool: asyncpg.Pool[Any], path: str
) -> None:
    """Found by adopting: the handler commits a row, adds two more, one a duplicate; the flush
    fails, and the handler catches the error without `session.rollback()` (SQLAlchemy undid the
    other). A held answer was refused (500, nothing recorded); one that cannot be held was
    settled and stored as a success, the undone write with it."""
    from sqlalchemy.exc import IntegrityError

    api = FastAPI()

    async def work(order_id: str, session: Any) -> None:
        session.add(Order(id=order_id, tenant="t", amount=1))
        await session.commit()  # (into the claim's transaction)
        session.add(Order(id=f"{order_id}-b", tenant="t", amount=2))
        session.add(Order(id=order_id, tenant="t", amount=3))
        with contextlib.suppress(IntegrityError):  # no session.rollback(): the second is gone
            await session.flush()

    @api.post("/events/{order_id}")
    async def events(order_id: str, session: ClaimSession) -> StreamingResponse:
        await work(order_id, session)

        async def stream() -> AsyncIterator[bytes]:
            yield b"data: placed\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @api.post("/export/{order_id}")
    async def export(order_id: str, session: ClaimSession) -> dict[str, str]:
        await work(order_id, session)
        return {"report": "x" * (1024 * 1024 + 1)}

    install(api, store=store, tenant_resolver=lambda scope: "t")
    async with client(api) as http:
        response = await http.post(f"/{path}/o3", headers={"Idempotency-Key": f"{path}-3"})
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 0
    assert await pool.fetchval("SELECT count(*) FROM test_sqla_orders") == 0
