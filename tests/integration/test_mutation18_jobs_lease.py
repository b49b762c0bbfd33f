"""jobs_lease.py, pinned against hand-made mutants (mutation18), on real PostgreSQL.

- A lease-mode job whose lease was lost while its fenced transaction was open ends that
  transaction (`fence.seal()`): otherwise it keeps the record's row lock and a pooled connection
  for good (the key wedged, the pool one connection short), and a helper of the job could still
  use the fenced connection after the run ended.
- A lease-mode job whose settlement met a blip while a duplicate marked the record `unknown`
  under the same generation (its lease lapsed) records its result over that `unknown` when it is
  sent again, as the settlement sent once does (`Fence.over_unknown`): otherwise the job raised
  StaleGeneration and its result was lost, the record left `unknown`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import IdempotencyContext, PostgresStore
from idem_middleware.errors import StaleGeneration, StoreError
from idem_middleware.jobs import idempotent_job
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey, Settlement, State

BOUND = 30.0
BLIP = "ConnectionDoesNotExistError: connection was closed"


class RenewalsDown(PostgresStore):
    """Its lease renewals never reach the server (their connection is lost each time)."""

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        raise StoreError(BLIP)


async def test_a_job_whose_lease_was_lost_ends_its_fenced_transaction(
    pool: asyncpg.Pool[Any],
) -> None:
    seen: list[IdempotencyContext] = []
    async with RenewalsDown(pool=pool, listen=False) as store:

        @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=0.5)
        async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
            seen.append(job)
            conn = await job.fenced_connection()
            await conn.execute("SELECT 1")
            await asyncio.wait_for(job.lease_lost.wait(), BOUND)
            raise StaleGeneration("this run's lease is lost: it stops")

        with pytest.raises(StaleGeneration, match="lease is lost"):
            await asyncio.wait_for(payout(ref="m18-seal"), BOUND)
        try:
            await _nothing_left_held(pool, seen[0])
        except BaseException:
            pool.terminate()  # (a connection never given back would hold the teardown for good)
            raise


async def _nothing_left_held(pool: asyncpg.Pool[Any], job: IdempotencyContext) -> None:
    """What a run must leave once it ended: no fenced session, no connection, no row lock."""
    # A helper of the run asking for the fenced connection after it ended is refused.
    with pytest.raises(StaleGeneration):
        await asyncio.wait_for(job.fenced_connection(), BOUND)
    # The pool has every connection back; no session is left in a transaction.
    assert pool.get_idle_size() == pool.get_size()
    idle_in_tx = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND state LIKE 'idle in transaction%'"
    )
    assert idle_in_tx == 0
    # Nobody holds the record's row: another session locks it at once.
    async with pool.acquire() as other, other.transaction():
        locked = await other.fetchval(
            "SELECT generation FROM idem_requests WHERE idem_key = 'm18-seal' FOR UPDATE NOWAIT"
        )
        assert locked is not None


class DuplicateMarksUnknownThenBlip(PostgresStore):
    """The first final settlement meets a blip, after a duplicate found the run's lease lapsed
    and marked the record `unknown` under the same generation."""

    blipped = False

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if not self.blipped and expected is State.PENDING and s.state is State.SUCCEEDED:
            self.blipped = True
            async with self.pool.acquire() as conn:
                await conn.execute(
                    "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
                    " WHERE idem_key = $1",
                    key.key,
                )
            assert await self.expire_lease(key, generation)  # the duplicate's mark
            raise StoreError(BLIP)
        return await super().settle(key, generation, expected, s)


async def test_a_jobs_result_sent_again_is_recorded_over_a_duplicates_unknown(
    pool: asyncpg.Pool[Any],
) -> None:
    runs: list[str] = []
    async with DuplicateMarksUnknownThenBlip(pool=pool, listen=False) as store:

        @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=60.0)
        async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
            runs.append(ref)
            return {"paid": ref}

        assert await asyncio.wait_for(payout(ref="m18-over"), BOUND) == {"paid": "m18-over"}
        assert store.blipped
        record = await store.get(RecordKey("", "payout", "m18-over"))
        assert record is not None
        assert record.state is State.SUCCEEDED, record.state
        assert await payout(ref="m18-over") == {"paid": "m18-over"}
        assert runs == ["m18-over"]
