"""A FastAPI handler with a `ClaimSession` that catches a failed statement and answers anyway, or
ends the claim's transaction through the session. Never a stored answer for writes that rolled
back, never committed writes without their outcome."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore
from tests.apps import assert_problem, count

_ROW = text("INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', :name, 1)")
_DUPLICATE = text("INSERT INTO test_accounts (tenant, account_id) VALUES ('t', 'taken')")


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "test_accounts"
    tenant: Mapped[str] = mapped_column(primary_key=True)
    account_id: Mapped[str] = mapped_column(primary_key=True)


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    await pool.execute("INSERT INTO test_accounts (tenant, account_id) VALUES ('t', 'taken')")
    async with PostgresStore(pool=pool) as store:
        yield store


class Calls:
    n = 0


def app_of(store: PostgresStore, calls: Calls) -> FastAPI:
    app = FastAPI()

    @app.post("/caught/{how}/{status}")
    async def caught(how: str, status: int, session: ClaimSession) -> Any:
        """A row, then a duplicate: by the ORM's flush (`flush`), or by a statement (`execute`),
        caught; `rollback`: the flush's, caught and rolled back (the documented way)."""
        calls.n += 1
        await session.execute(_ROW, {"name": "before"})
        try:
            if how == "execute":
                await session.execute(_DUPLICATE)
            else:
                session.add(Account(tenant="t", account_id="taken"))
                await session.flush()
        except DBAPIError:
            if how == "rollback":
                await session.rollback()
            return JSONResponse({"duplicate": True}, status_code=status)
        return JSONResponse({"ok": True}, status_code=201)

    @app.post("/ended/{statement}", status_code=201)
    async def ended(statement: str, session: ClaimSession) -> Any:
        calls.n += 1
        await session.execute(_ROW, {"name": "before"})
        for sql in statement.split("-"):
            await session.execute(text(sql.upper()))
        await session.execute(_ROW, {"name": "after"})
        return {"ok": True}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    return app


async def _twice(store: PostgresStore, path: str) -> tuple[httpx.Response, httpx.Response, int]:
    calls = Calls()
    transport = httpx.ASGITransport(app=app_of(store, calls), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first = await http.post(path, json={}, headers={"Idempotency-Key": path})
        again = await http.post(path, json={}, headers={"Idempotency-Key": path})
    return first, again, calls.n


@pytest.mark.parametrize("how", ["flush", "execute"])
async def test_a_stored_answer_after_a_caught_failure_is_refused(
    store: PostgresStore, pool: asyncpg.Pool[Any], how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing. `flush`: SQLAlchemy rolled the session's writes back at the failed
    flush, and the dependency's end let the handler's 201 be stored and replayed, for a row that
    was never written. `execute`: the dependency's commit met the aborted transaction, a
    text/plain 500 with a traceback."""
    caplog.set_level(logging.ERROR, logger="idem_middleware")
    first, again, calls = await _twice(store, f"/caught/{how}/201")
    assert_problem(first, 500, "server-misconfigured")
    assert_problem(again, 500, "server-misconfigured")
    assert calls == 2
    assert await count(pool, "idem_requests") == 0
    assert await count(pool, "test_ledger") == 0
    assert "session.begin_nested()" in caplog.text


@pytest.mark.parametrize("how", ["flush", "execute"])
async def test_a_releasing_answer_after_a_caught_failure_reaches_the_client(
    store: PostgresStore, pool: asyncpg.Pool[Any], how: str
) -> None:
    first, again, calls = await _twice(store, f"/caught/{how}/409")
    assert (first.status_code, again.status_code) == (409, 409), first.text
    assert first.json() == {"duplicate": True}
    assert calls == 2
    assert await count(pool, "idem_requests") == 0
    assert await count(pool, "test_ledger") == 0


async def test_a_caught_failure_rolled_back_by_the_handler_is_its_answer(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """`except IntegrityError: await session.rollback()` is the handler's own decision: its
    answer is stored, without the session's writes since its last commit."""
    first, again, calls = await _twice(store, "/caught/rollback/201")
    assert first.status_code == 201
    assert again.headers.get("idempotent-replayed") == "true"
    assert calls == 1
    assert await count(pool, "test_ledger") == 0


@pytest.mark.parametrize("statement", ["commit", "rollback"])
async def test_a_transaction_ended_through_the_session_keeps_its_outcome(
    store: PostgresStore, pool: asyncpg.Pool[Any], statement: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: `session.execute(text("COMMIT"))` ended the claim's transaction, the
    session's later writes committed on their own, and its savepoint's end then failed: a 500,
    no outcome recorded, and the retry wrote everything again. Now the outcome is recorded, as
    for a COMMIT on the asyncpg connection, and the ended transaction is logged as an error."""
    caplog.set_level(logging.ERROR)
    first, again, calls = await _twice(store, f"/ended/{statement}")
    assert first.status_code == 201, first.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert calls == 1
    rows = await pool.fetch("SELECT account_id FROM test_ledger ORDER BY id")
    expected = ["after"] if statement == "rollback" else ["before", "after"]
    assert [r["account_id"] for r in rows] == expected
    assert "ended the claim's transaction itself" in caplog.text
