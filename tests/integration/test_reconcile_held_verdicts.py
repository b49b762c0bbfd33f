"""A reconciler whose fenced transaction could not be had (another session held the record, or
no pooled connection came within `held_wait`) answered without the record: the verdict is
HELD whatever it made of that (its "not happened" would run the request again, its failure
answer a client 409 and count the record failed), and its answer is not used."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ClaimBusy
from idem_middleware.fence import Verdict, run_reconciler
from idem_middleware.reconcile import NotHappened, ReconcileContext, Reconciliation
from idem_middleware.store import Claimed, MemoryStore
from idem_middleware.store.base import RecordKey, Settlement, State, Store, StoredResponse

KEY = RecordKey("t", "POST /payouts", "k")


async def _unknown(store: Store) -> int:
    claim = await store.claim_lease(KEY, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await store.settle(KEY, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
    return claim.generation


@pytest.fixture
async def one_connection(db_dsn: str) -> AsyncIterator[asyncpg.Pool[Any]]:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=1)
    await pool.execute("DELETE FROM idem_requests")
    try:
        yield pool
    finally:
        await pool.close()


@pytest.mark.parametrize("answer", ["raises", "not-happened"])
async def test_a_fence_that_waited_past_held_wait_for_a_connection_is_held(
    one_connection: asyncpg.Pool[Any], answer: str
) -> None:
    """No pooled connection for the fence within `held_wait` (the reconciler sees a
    TimeoutError): HELD, whether the reconciler let the TimeoutError out or answered anyway."""
    async with PostgresStore(pool=one_connection, listen=False) as store:
        generation = await _unknown(store)
        asked = 0

        async def reconciler(ctx: ReconcileContext) -> Reconciliation:
            nonlocal asked
            asked += 1
            if answer == "raises":
                await ctx.fenced_connection()
            with contextlib.suppress(TimeoutError):
                await ctx.fenced_connection()
            return NotHappened()

        async with one_connection.acquire():  # the pool's only connection is taken
            result = await asyncio.wait_for(
                run_reconciler(
                    store, KEY, generation, reconciler, seconds=5, held_wait=0.2, by_hand=False
                ),
                5,
            )
        assert result.verdict is Verdict.HELD
        assert asked == 1
        record = await store.get(KEY)
        assert record is not None
        assert (record.state, record.generation) == (State.UNKNOWN, generation)


async def test_a_fence_refused_after_another_session_held_the_record_is_held() -> None:
    """The reconciler found the record held (ClaimBusy), asked for its fence again, and found
    the record changed by then (StaleGeneration): HELD still, as the record was held when it
    first asked."""
    store = MemoryStore()
    generation = await _unknown(store)
    other = contextlib.AsyncExitStack()
    await other.enter_async_context(store.fenced(KEY, generation, State.UNKNOWN))

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        with contextlib.suppress(ClaimBusy):
            await ctx.fenced_connection()
        await other.aclose()  # the other session settles the record meanwhile
        done = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
        assert await store.settle(KEY, generation, State.UNKNOWN, done)
        await ctx.fenced_connection()  # refused: the record changed under this generation
        return NotHappened()  # pragma: no cover

    async with other:
        result = await run_reconciler(store, KEY, generation, reconciler, seconds=5)
    assert result.verdict is Verdict.HELD
