"""One AsyncSession shared by requests (made at import, as `db = SessionLocal()` is), on real
PostgreSQL.

While request A's transaction holds the session's connection, request B's statements through it
ran on A's connection, in A's claim: B's write committed or rolled back with A's outcome, not its
own. A failing A lost B's write while B's outcome said it succeeded (a retry replays it); a
failing B released its key while its write committed with A, and B's retry wrote it again. A
statement from another claim's task (or from no claim's: an unguarded route) must be refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from idem_middleware.fastapi import install
from idem_middleware.sqla import claim_engine, open_claim_session
from idem_middleware.store.postgres import PostgresStore

ROW = text("INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', :who, 1)")


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pool=pool) as store:
        yield store


def app_of(store: PostgresStore, a_fails: bool) -> FastAPI:
    app = FastAPI()
    shared: dict[str, Any] = {}  # the module-level session of a careless app
    a_wrote, b_done = asyncio.Event(), asyncio.Event()

    @app.post("/a", status_code=201)
    async def a() -> dict[str, str]:
        session = shared["session"] = AsyncSession(claim_engine())
        await session.execute(ROW, {"who": "a"})
        a_wrote.set()
        await b_done.wait()
        if a_fails:
            raise RuntimeError("A fails after its write")
        await session.commit()
        return {"ok": "a"}

    @app.post("/b/{how}", status_code=201)
    async def b(how: str) -> dict[str, str]:
        if how == "own":  # the retry, with a session of its own
            async with open_claim_session() as session:
                await session.execute(ROW, {"who": "b"})
            return {"ok": "b"}
        await a_wrote.wait()
        try:
            await shared["session"].execute(ROW, {"who": "b"})
        except Exception:
            if how == "rolls-back":  # as a session dependency's teardown does on an error
                await shared["session"].rollback()
            raise
        finally:
            b_done.set()
        if how == "fails":
            raise RuntimeError("B fails after its write")
        return {"ok": "b"}

    @app.get("/unguarded")  # (GET: never guarded)
    async def unguarded() -> dict[str, str]:
        await a_wrote.wait()
        try:
            await shared["session"].execute(ROW, {"who": "unguarded"})
        finally:
            b_done.set()
        return {"ok": "unguarded"}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    return app


async def rows(pool: asyncpg.Pool[Any]) -> list[str]:
    found = await pool.fetch("SELECT account_id FROM test_ledger ORDER BY account_id")
    return [r["account_id"] for r in found]


async def states(pool: asyncpg.Pool[Any]) -> dict[str, str]:
    found = await pool.fetch("SELECT idem_key, state FROM idem_requests")
    return {r["idem_key"]: r["state"] for r in found}


async def test_a_write_through_another_requests_session_is_refused_not_lost(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """A fails: B's write must not be lost with A's transaction while B is stored as done."""
    transport = httpx.ASGITransport(app=app_of(store, a_fails=True), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first_a, first_b = await asyncio.gather(
            http.post("/a", headers={"Idempotency-Key": "ka"}),
            http.post("/b/ok", headers={"Idempotency-Key": "kb"}),
        )
        assert first_a.status_code == 500
        assert first_b.status_code == 500, first_b.text  # refused, not "201" for a lost write
        assert await states(pool) == {}  # B's key is free: its retry runs
        retry = await http.post("/b/own", headers={"Idempotency-Key": "kb"})
    assert retry.status_code == 201, retry.text
    assert await rows(pool) == ["b"]
    assert await states(pool) == {"kb": "succeeded"}


async def test_a_failed_request_s_write_does_not_commit_with_another_claim(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """B fails after its write: the write must not commit with A, or B's retry makes it twice."""
    transport = httpx.ASGITransport(app=app_of(store, a_fails=False), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first_a, first_b = await asyncio.gather(
            http.post("/a", headers={"Idempotency-Key": "ka"}),
            http.post("/b/fails", headers={"Idempotency-Key": "kb"}),
        )
        assert first_b.status_code == 500
        retry = await http.post("/b/own", headers={"Idempotency-Key": "kb"})
    assert first_a.status_code == 201, first_a.text  # A's own write is untouched
    assert retry.status_code == 201, retry.text
    assert await rows(pool) == ["a", "b"]  # B's effect exactly once
    assert await states(pool) == {"ka": "succeeded", "kb": "succeeded"}


async def test_an_unguarded_routes_statement_never_runs_in_a_claim(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    transport = httpx.ASGITransport(app=app_of(store, a_fails=True), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first_a, unguarded = await asyncio.gather(
            http.post("/a", headers={"Idempotency-Key": "ka"}),
            http.get("/unguarded"),
        )
    assert first_a.status_code == 500
    assert unguarded.status_code == 500  # refused, not rolled back silently with A's claim
    assert await rows(pool) == []


async def test_another_requests_rollback_does_not_undo_a_claims_writes(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """B's statement is refused, and B rolls the shared session back in its error path: that
    must not roll A's savepoint back (A's write lost, A's record `succeeded` all the same)."""
    transport = httpx.ASGITransport(app=app_of(store, a_fails=False), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first_a, first_b = await asyncio.gather(
            http.post("/a", headers={"Idempotency-Key": "ka"}),
            http.post("/b/rolls-back", headers={"Idempotency-Key": "kb"}),
        )
    assert first_b.status_code == 500
    assert first_a.status_code == 201, first_a.text
    assert await rows(pool) == ["a"]  # A's effect, as its record says
    assert await states(pool) == {"ka": "succeeded"}
