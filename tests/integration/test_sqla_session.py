"""SQLAlchemy AsyncSession (and SQLModel's) inside the claim's transaction, on real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from sqlalchemy import JSON, String, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, idempotent
from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession, ClaimSessions, open_claim_session
from idem_middleware.store.postgres import PostgresStore
from tests.apps import BearerBackend

# Also through PgBouncer (statement_cache_size=0): the session's statements are asyncpg's
# unnamed ones there, inside the claim's transaction.
pytestmark = pytest.mark.db_routes("pgbouncer")

AUTH = {"Authorization": "Bearer demo-a"}


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "test_sqla_orders"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    tenant: Mapped[str]
    amount: Mapped[int]
    meta: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


@pytest.fixture
async def store(pool: asyncpg.Pool[Any], db_route: str) -> AsyncIterator[PostgresStore]:
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS test_sqla_orders (id text PRIMARY KEY, tenant text NOT NULL, "
        "amount bigint NOT NULL, meta json)"
    )
    await pool.execute("TRUNCATE test_sqla_orders")
    # (Through PgBouncer in transaction mode LISTEN cannot work: refused when the store opens.)
    async with PostgresStore(pool=pool, listen=db_route != "pgbouncer") as store:
        yield store


class Calls:
    def __init__(self) -> None:
        self.count = 0


def fastapi_app(store: PostgresStore, calls: Calls) -> FastAPI:
    app = FastAPI()

    @app.post("/orders/{order_id}")
    async def create(order_id: str, request: Request, session: ClaimSession) -> dict[str, Any]:
        calls.count += 1
        body = await request.json()
        session.add(Order(id=order_id, tenant="a", amount=body["amount"], meta={"n": 1}))
        await session.flush()
        total = (await session.execute(text("SELECT sum(amount) FROM test_sqla_orders"))).scalar()
        if body.get("fail"):
            raise RuntimeError("boom after the write")
        if body.get("reject"):
            raise HTTPException(422, "rejected after the write")
        if body.get("commit"):
            await session.commit()  # releases the session's savepoint: the outcome commits
            if body.get("fail_after_commit"):
                raise RuntimeError("boom after session.commit()")
        return {"order": order_id, "total": int(total or 0)}

    @app.post("/dup/{order_id}")
    async def duplicate(order_id: str, session: ClaimSession) -> dict[str, Any]:
        """A duplicate primary key caught and rolled back: the claim survives it."""
        calls.count += 1
        session.add(Order(id=order_id, tenant="a", amount=1))
        await session.commit()
        session.add(Order(id=order_id, tenant="a", amount=2))
        try:
            await session.flush()
        except IntegrityError:
            await session.rollback()
        found = (await session.execute(select(Order.amount).where(Order.id == order_id))).all()
        return {"amounts": [a for (a,) in found]}

    @app.post("/lease/{order_id}")
    @idempotent(mode=Mode.LEASE)
    async def lease(order_id: str, request: Request, session: ClaimSession) -> dict[str, Any]:
        calls.count += 1
        body = await request.json()
        session.add(Order(id=order_id, tenant="a", amount=body["amount"]))
        await session.commit()
        if body.get("fail"):
            raise RuntimeError("boom in lease mode")
        return {"order": order_id}

    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://test",
    )


async def orders(pool: asyncpg.Pool[Any]) -> list[str]:
    return [r["id"] for r in await pool.fetch("SELECT id FROM test_sqla_orders ORDER BY id")]


async def records(pool: asyncpg.Pool[Any]) -> list[str]:
    return [r["state"] for r in await pool.fetch("SELECT state FROM idem_requests")]


async def test_success_commits_rows_and_claim_and_replays(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    calls = Calls()
    async with client(fastapi_app(store, calls)) as http:
        headers = {**AUTH, "Idempotency-Key": "ok-1"}
        first = await http.post("/orders/o1", json={"amount": 5}, headers=headers)
        second = await http.post("/orders/o1", json={"amount": 5}, headers=headers)
    assert first.status_code == 200, first.text
    assert first.json() == {"order": "o1", "total": 5}
    assert second.content == first.content
    assert second.headers.get("idempotent-replayed") == "true"
    assert calls.count == 1
    assert await orders(pool) == ["o1"]
    assert await records(pool) == ["succeeded"]
    # JSON went through SQLAlchemy's own parsing, and the store's connections keep asyncpg's
    # text decoding (the stock dialect would have installed its codecs on them).
    assert await pool.fetchval("SELECT meta FROM test_sqla_orders") == '{"n": 1}'


@pytest.mark.parametrize("commit", [False, True])
async def test_failure_rolls_back_rows_and_claim(
    store: PostgresStore, pool: asyncpg.Pool[Any], commit: bool
) -> None:
    calls = Calls()
    body = {"amount": 5, "commit": commit, "fail_after_commit": commit, "fail": not commit}
    async with client(fastapi_app(store, calls)) as http:
        headers = {**AUTH, "Idempotency-Key": f"fail-{commit}"}
        response = await http.post("/orders/o2", json=body, headers=headers)
        assert response.status_code == 500
        assert await orders(pool) == []
        assert await records(pool) == []  # the key is free again
        retry = await http.post("/orders/o2", json={"amount": 5}, headers=headers)
    assert retry.status_code == 200
    assert calls.count == 2
    assert await orders(pool) == ["o2"]


async def test_release_status_rolls_back_session_writes(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    async with client(fastapi_app(store, Calls())) as http:
        response = await http.post(
            "/orders/o3",
            json={"amount": 1, "reject": True},
            headers={**AUTH, "Idempotency-Key": "r"},
        )
    assert response.status_code == 422
    assert await orders(pool) == []
    assert await records(pool) == []


async def test_session_commit_only_releases_a_savepoint(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """session.commit() leaves the claim's transaction open; session.rollback() keeps the claim."""
    calls = Calls()
    async with client(fastapi_app(store, calls)) as http:
        headers = {**AUTH, "Idempotency-Key": "dup-1"}
        first = await http.post("/dup/o4", json={}, headers=headers)
        second = await http.post("/dup/o4", json={}, headers=headers)
    assert first.status_code == 200, first.text
    assert first.json() == {"amounts": [1]}
    assert second.content == first.content
    assert calls.count == 1
    assert await records(pool) == ["succeeded"]


async def test_lease_mode_writes_in_the_fenced_transaction(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    calls = Calls()
    async with client(fastapi_app(store, calls)) as http:
        ok = {**AUTH, "Idempotency-Key": "lease-ok"}
        first = await http.post("/lease/o5", json={"amount": 3}, headers=ok)
        second = await http.post("/lease/o5", json={"amount": 3}, headers=ok)
        failed = await http.post(
            "/lease/o6", json={"amount": 3, "fail": True}, headers={**AUTH, "Idempotency-Key": "lf"}
        )
    assert first.status_code == 200, first.text
    assert second.content == first.content
    assert second.headers.get("idempotent-replayed") == "true"
    assert failed.status_code == 500
    assert calls.count == 2
    # The failed execution's fenced write rolled back; its record is unknown (lease mode).
    assert await orders(pool) == ["o5"]
    states = {
        r["idem_key"]: r["state"]
        for r in await pool.fetch("SELECT idem_key, state FROM idem_requests")
    }
    assert states == {"lease-ok": "succeeded", "lf": "unknown"}


async def test_starlette_session_and_sqlmodel(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    sqlmodel_session = pytest.importorskip("sqlmodel.ext.asyncio.session")
    sessions = ClaimSessions(session_class=sqlmodel_session.AsyncSession)

    async def create(request: Request) -> JSONResponse:
        async with sessions.session(request) as session:
            assert isinstance(session, sqlmodel_session.AsyncSession)
            session.add(Order(id="s1", tenant="a", amount=2))
            await session.flush()
            count = (await session.exec(select(Order.id))).all()  # SQLModel's exec()
        async with open_claim_session(request) as again:  # the default sessions, same claim
            await again.execute(text("UPDATE test_sqla_orders SET amount = amount + 1"))
        if (await request.json()).get("fail"):
            raise RuntimeError("boom")
        return JSONResponse({"count": len(count)})

    app = Starlette(
        routes=[Route("/s", create, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )
    async with client(app) as http:
        failed = await http.post(
            "/s", json={"fail": True}, headers={**AUTH, "Idempotency-Key": "f"}
        )
        assert failed.status_code == 500
        assert await orders(pool) == []
        ok = await http.post("/s", json={}, headers={**AUTH, "Idempotency-Key": "s"})
    assert ok.json() == {"count": 1}
    assert await pool.fetchval("SELECT amount FROM test_sqla_orders WHERE id = 's1'") == 3
    await sessions.engine.dispose()


async def test_outside_a_claim_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no idempotency claim"):
        async with open_claim_session():
            pass
