"""jobs_transactional.py, pinned against hand-made mutants (mutation18), on real PostgreSQL.

- A conflict the store met itself (the COMMIT's serialization failure), not the function's
  writes, that outlasts the retries raises the library's RetryableConflict, not the driver's
  error behind it (only the function's own error is raised as it raised it).
- A job cancelled after its claim's connection was lost stays cancelled: the cancellation is
  not turned into the lost connection's StoreError (an `asyncio.timeout` around it, a shutdown's
  cancel, would be lost).
- A run that finds the key busy gives up after `wait_seconds`, not later.
- A claim that ran out of time inside the database (ClaimTimeout: the record kept changing, or
  a concurrent claim's row held past the wait) is JobInProgress for the caller, as a busy key
  is, not the store's ClaimTimeout (a consumer that retries later on JobInProgress crashed).
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import IdempotencyContext
from idem_middleware.errors import ClaimTimeout, RetryableConflict
from idem_middleware.jobs import JobInProgress, idempotent_job
from idem_middleware.store.base import RecordKey
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_http_failures import connection_closed

BOUND = 30.0

_CONFLICT_AT_COMMIT = """
CREATE TABLE m18_commit_conflicts (ref text);
CREATE FUNCTION m18_conflict() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'could not serialize access' USING ERRCODE = 'serialization_failure';
END $$;
CREATE CONSTRAINT TRIGGER m18_conflict AFTER INSERT ON m18_commit_conflicts
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION m18_conflict();
"""


async def test_a_conflict_at_commit_that_outlasts_the_retries_is_a_retryable_conflict(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    await pool.execute("DROP TABLE IF EXISTS m18_commit_conflicts")
    await pool.execute("DROP FUNCTION IF EXISTS m18_conflict()")
    await pool.execute(_CONFLICT_AT_COMMIT)
    runs: list[str] = []
    try:

        @idempotent_job(
            pg_store, operation="commit.conflict", key="ref", max_serialization_retries=1
        )
        async def job(ctx: IdempotencyContext, *, ref: str) -> str:
            runs.append(ref)
            await ctx.connection.execute("INSERT INTO m18_commit_conflicts VALUES ($1)", ref)
            return ref

        with pytest.raises(RetryableConflict) as raised:
            await asyncio.wait_for(job(ref="c1"), BOUND)
        assert not raised.value.from_handler
        assert runs == ["c1", "c1"]
        assert await pg_store.get(RecordKey("", "commit.conflict", "c1")) is None
    finally:
        await pool.execute("DROP TABLE m18_commit_conflicts")
        await pool.execute("DROP FUNCTION m18_conflict()")


async def test_a_job_cancelled_after_its_connection_was_lost_stays_cancelled(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    lost = asyncio.Event()

    @idempotent_job(pg_store, operation="lost.cancelled", key="ref")
    async def job(ctx: IdempotencyContext, *, ref: str) -> str:
        conn = ctx.connection
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
        for _ in range(int(BOUND / 0.01)):
            if connection_closed(conn):
                break
            await asyncio.sleep(0.01)
        lost.set()
        await asyncio.sleep(BOUND)  # (cancelled here: a shutdown, a timeout around the job)
        return ref

    task = asyncio.create_task(job(ref="x1"))
    await asyncio.wait_for(lost.wait(), BOUND)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND)
    assert task.cancelled()
    assert await pg_store.get(RecordKey("", "lost.cancelled", "x1")) is None


async def test_a_run_finding_the_key_busy_gives_up_after_wait_seconds(
    pg_store: PostgresStore,
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    @idempotent_job(pg_store, operation="busy.bound", key="k", wait_seconds=1.0)
    async def slow(job: IdempotencyContext, *, k: str) -> str:
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return "done"

    first = asyncio.create_task(slow(k="same"))
    await asyncio.wait_for(entered.wait(), BOUND)
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        with pytest.raises(JobInProgress):
            await asyncio.wait_for(slow(k="same"), BOUND)
        waited = loop.time() - began
        # (Twice wait_seconds would be 2.0: the margin is for a loaded machine.)
        assert 1.0 <= waited < 1.95, waited
    finally:
        release.set()
        assert await asyncio.wait_for(first, BOUND) == "done"


class ClaimsTimeOut(PostgresStore):
    """Its transactional claims run out of time (the record kept changing under them)."""

    def transaction(self, *, acquire_timeout: float) -> Any:
        return _TimingOut(super().transaction(acquire_timeout=acquire_timeout))


class _TimingOut:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aenter__(self) -> Any:
        return _TimedOutSession(await self.inner.__aenter__())

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.inner.__aexit__(*exc)


class _TimedOutSession:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise ClaimTimeout("the record kept changing under the claim")


async def test_a_claim_that_ran_out_of_time_is_job_in_progress(pool: asyncpg.Pool[Any]) -> None:
    runs: list[str] = []
    async with ClaimsTimeOut(pool=pool, listen=False) as store:

        @idempotent_job(store, operation="claim.timeout", key="k", wait_seconds=0.2)
        async def job(ctx: IdempotencyContext, *, k: str) -> str:
            runs.append(k)
            return k

        with pytest.raises(JobInProgress):
            await asyncio.wait_for(job(k="t1"), BOUND)
        assert runs == []
