"""A claim connection that dies (or that SQLAlchemy invalidates) fails its own request only.

SQLAlchemy's pool answers a disconnect by marking every connection it has seen for recycling at
its next checkout; a claim engine opens no connections of its own, so that recycling failed the
healthy requests on the other pooled connections with 500 (lease mode: left `unknown`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

import asyncpg
import httpx
import pytest
from fastapi import Depends, FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.requests import Request

from idem_middleware import Mode, idempotent
from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSessions
from idem_middleware.store.postgres import PostgresStore

PID = text("SELECT pg_backend_pid()")


class Fresh:
    """The sessions of a ClaimSessions made anew for each test: its engine's pool starts clean."""

    sessions: ClaimSessions

    async def dependency(self, request: Request) -> AsyncIterator[AsyncSession]:
        async with self.sessions.session(request) as session:
            yield session


FRESH = Fresh()
Session = Annotated[AsyncSession, Depends(FRESH.dependency)]


@pytest.fixture(autouse=True)
def fresh_sessions() -> None:
    FRESH.sessions = ClaimSessions()


def client(api: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api, raise_app_exceptions=False),
        base_url="http://test",
    )


async def states(pool: asyncpg.Pool[Any]) -> dict[str, str]:
    rows = await pool.fetch("SELECT idem_key, state FROM idem_requests")
    return {r["idem_key"]: r["state"] for r in rows}


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_lost_claim_connection_fails_only_its_own_request(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode
) -> None:
    api = FastAPI()
    ready = {"a": asyncio.Event(), "b": asyncio.Event()}
    died = asyncio.Event()

    @api.post("/work/{name}")
    @idempotent(mode=mode)
    async def work(name: str, session: Session) -> dict[str, int]:
        first = (await session.execute(PID)).scalar_one()  # this connection's entry is made
        await session.commit()  # checked in: the next statement checks it out again
        ready[name].set()
        await asyncio.wait_for(died.wait(), 10)
        again = (await session.execute(PID)).scalar_one()
        assert again == first
        return {"pid": again}

    @api.post("/die")
    @idempotent(mode=mode)
    async def die(session: Session) -> dict[str, bool]:
        pid = (await session.execute(PID)).scalar_one()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready.values())), 10)
        try:
            assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
            for _ in range(200):  # until the server has closed it
                if not await pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
                ):
                    break
                await asyncio.sleep(0.01)
            await session.execute(text("SELECT 1"))  # a disconnect
        finally:
            died.set()
        return {"unreachable": True}

    install(api, store=pg_store, tenant_resolver=lambda scope: "t")
    async with client(api) as http:

        async def post(path: str, key: str) -> httpx.Response:
            return await http.post(path, headers={"Idempotency-Key": key})

        a, b, dead = await asyncio.wait_for(
            asyncio.gather(post("/work/a", "a"), post("/work/b", "b"), post("/die", "dead")), 30
        )
        after = await post("/work/a", "after")  # (ready and died are set: it runs through)

    assert dead.status_code == 503, dead.text
    assert (a.status_code, b.status_code) == (200, 200), (a.text, b.text)
    assert a.json()["pid"] != b.json()["pid"]
    assert after.status_code == 200, after.text
    recorded = await states(pool)
    assert {k: recorded.get(k) for k in ("a", "b", "after")} == dict.fromkeys(
        ("a", "b", "after"), "succeeded"
    )
    # Lease mode cannot know whether the fenced transaction committed; transactional mode's
    # claim rolled back with the connection.
    assert recorded.get("dead") == ("unknown" if mode is Mode.LEASE else None)


async def test_a_soft_invalidated_entry_is_made_again(pg_store: PostgresStore) -> None:
    """`invalidate(soft=True)` marks the entry for recycling at its next checkout, which would
    open a connection of its own: the claim's connection gets a new entry instead."""
    api = FastAPI()

    @api.post("/soft")
    @idempotent()
    async def soft(session: Session) -> dict[str, int]:
        first = (await session.execute(PID)).scalar_one()
        raw = await (await session.connection()).get_raw_connection()
        raw.invalidate(soft=True)
        await session.commit()
        again = (await session.execute(PID)).scalar_one()
        assert again == first
        return {"pid": again}

    install(api, store=pg_store, tenant_resolver=lambda scope: "t")
    async with client(api) as http:
        answer = await http.post("/soft", headers={"Idempotency-Key": "soft"})
    assert answer.status_code == 200, answer.text
