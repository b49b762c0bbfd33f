"""A transactional job whose own writes meet a serialization failure is run again, at most
`max_serialization_retries` times, and then raises the function's own error (as a request's
handler's propagates), not the library's RetryableConflict wrapper."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from idem_middleware import IdempotencyContext
from idem_middleware.jobs import idempotent_job
from idem_middleware.store.base import RecordKey
from idem_middleware.store.postgres import PostgresStore


async def test_a_job_meeting_a_serialization_failure_runs_again_then_succeeds(
    pg_store: PostgresStore,
) -> None:
    """A conflict on the first run is retried: the job runs twice and its second result stands."""
    runs = 0

    @idempotent_job(pg_store, operation="retry.once", key="ref", max_serialization_retries=1)
    async def job(ctx: IdempotencyContext, *, ref: str) -> int:
        nonlocal runs
        runs += 1
        await ctx.connection.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('', $1, $2)", ref, runs
        )
        if runs == 1:
            raise asyncpg.exceptions.SerializationError("could not serialize access")
        return runs

    assert await job(ref="r-1") == 2
    assert runs == 2
    amounts = [r["amount"] for r in await pg_store.pool.fetch("SELECT amount FROM test_ledger")]
    assert amounts == [2]  # the first run's write rolled back with its claim


@pytest.mark.parametrize("retries", [0, 2])
async def test_a_job_whose_conflicts_outlast_its_retries_raises_its_own_error(
    pg_store: PostgresStore, retries: int
) -> None:
    """Exactly 1 + max_serialization_retries runs, then the function's own exception; the key
    is free afterwards (nothing recorded)."""
    runs = 0

    @idempotent_job(pg_store, operation="retry.never", key="ref", max_serialization_retries=retries)
    async def job(ctx: IdempotencyContext, *, ref: str) -> Any:
        nonlocal runs
        runs += 1
        raise asyncpg.exceptions.SerializationError("could not serialize access")

    with pytest.raises(asyncpg.exceptions.SerializationError):
        await job(ref="r-2")
    assert runs == 1 + retries
    assert await pg_store.get(RecordKey("", "retry.never", "r-2")) is None
