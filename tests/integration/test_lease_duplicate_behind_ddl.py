"""A lease-mode duplicate (a request's, or a job's) waits for the original at most its
`wait_seconds`, also when a migration holds the table (`ALTER TABLE`: ACCESS EXCLUSIVE) while
it waits: its read of the record is bounded by what is left of its wait. It waited for the
whole lock (a migration of minutes, a request held as long), past the bound the docs give."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import IdempotencyContext, Mode, Policy, PostgresStore
from idem_middleware.errors import JobInProgress
from idem_middleware.jobs import idempotent_job
from tests.apps import BOUND, assert_problem, client, key, one_route_app, wait_for_waiters

#: Well inside the lock the test holds: answered while the table is still locked.
WAIT = 0.3
ANSWERED_WITHIN = 3.0


@asynccontextmanager
async def table_locked(pool: asyncpg.Pool[Any]) -> AsyncIterator[None]:
    async with pool.acquire() as other, other.transaction():
        await other.execute("LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE")
        yield


async def test_a_waiting_duplicate_is_answered_within_its_wait_behind_a_table_lock(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    async def pay(request: Request) -> Response:
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return JSONResponse({"paid": True}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=WAIT)
    app = one_route_app("/pay", pay, store=pg_store, default_policy=policy)
    async with client(app) as c:
        first = asyncio.create_task(c.post("/pay", json={}, headers=key("k1")))
        await asyncio.wait_for(entered.wait(), BOUND)
        duplicate = asyncio.create_task(c.post("/pay", json={}, headers=key("k1")))
        await wait_for_waiters(app)
        async with table_locked(pool):
            reply = await asyncio.wait_for(duplicate, ANSWERED_WITHIN)
        release.set()
        original = await asyncio.wait_for(first, BOUND)
    assert_problem(reply, 409, "request-in-flight")
    assert original.status_code == 201


async def test_a_waiting_lease_job_gives_up_within_its_wait_behind_a_table_lock(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()
    spec = {"operation": "payout", "key": "ref", "mode": Mode.LEASE, "wait_seconds": WAIT}

    @idempotent_job(pg_store, **spec)  # type: ignore[arg-type]
    async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return {"paid": ref}

    first = asyncio.create_task(payout(ref="p1"))
    await asyncio.wait_for(entered.wait(), BOUND)
    again = asyncio.create_task(payout(ref="p1"))
    await asyncio.sleep(0.1)  # (its first look found the run in flight: it waits)
    async with table_locked(pool):
        with pytest.raises(JobInProgress):
            await asyncio.wait_for(again, ANSWERED_WITHIN)
    release.set()
    assert await asyncio.wait_for(first, BOUND) == {"paid": "p1"}
