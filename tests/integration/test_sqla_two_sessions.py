"""Two claim sessions of different ClaimSessions in one request, on real PostgreSQL.

Each ClaimSessions has its own engine; both hand out the claim's one connection. Used together,
their savepoints nested on that connection and released each other's (`session.commit()` of one
failed with "savepoint does not exist", or worse, ran the other's writes outside its savepoint).
The second checkout must raise the documented RuntimeError instead, before any statement.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import asyncpg
import httpx
import pytest
from fastapi import Depends, FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession, ClaimSessions
from idem_middleware.store.postgres import PostgresStore

#: A second ClaimSessions (e.g. SQLModel's sessions beside the default ClaimSession).
OTHER = ClaimSessions()
Second = Annotated[AsyncSession, Depends(OTHER.dependency)]
INSERT = text("INSERT INTO test_accounts (tenant, account_id) VALUES ('t', :id)")


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pool=pool) as store:
        yield store


async def test_a_second_engines_session_is_refused_while_the_first_holds_the_claim(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    app = FastAPI()
    calls: list[str] = []

    @app.post("/two")
    async def two(session: ClaimSession, second: Second) -> dict[str, str]:
        calls.append("two")
        await session.execute(INSERT, {"id": "first"})
        await second.execute(INSERT, {"id": "second"})
        await session.commit()
        return {"ok": "yes"}

    @app.post("/one-after-the-other")
    async def sequential(session: ClaimSession, second: Second) -> dict[str, str]:
        await session.execute(INSERT, {"id": "a"})
        await session.commit()  # gives the connection back: the other engine may have it now
        await second.execute(INSERT, {"id": "b"})
        return {"ok": "yes"}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        with pytest.raises(RuntimeError, match="already in use by another SQLAlchemy"):
            await http.post("/two", headers={"Idempotency-Key": "two"})
        ok = await http.post("/one-after-the-other", headers={"Idempotency-Key": "seq"})
    assert calls == ["two"]
    assert ok.status_code == 200, ok.text
    accounts = await pool.fetch("SELECT account_id FROM test_accounts ORDER BY account_id")
    assert [r["account_id"] for r in accounts] == ["a", "b"]  # nothing of the refused request
    states = await pool.fetch("SELECT idem_key, state FROM idem_requests")
    assert {r["idem_key"]: r["state"] for r in states} == {"seq": "succeeded"}
