"""jobs_lease.py, pinned against a hand-made mutant (mutation17): a lease-mode job whose fenced
settlement failed on a blip before its COMMIT landed (the function's writes rolled back with
it) is never recorded by a compare-and-set sent again: its result would stand for writes that
never happened. The record is marked `unknown` and the job raises."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware import IdempotencyContext, PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.jobs import idempotent_job
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey, Settlement, State

BOUND = 30.0


class FailFencedCommit(PostgresStore):
    """Its fenced sessions' settlements fail as if the connection died before the COMMIT."""

    def fenced(self, key: RecordKey, generation: int, expected: State) -> Any:
        return _Fencing(super().fenced(key, generation, expected))


class _Fencing:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aenter__(self) -> Any:
        return _Session(await self.inner.__aenter__())

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.inner.__aexit__(*exc)


class _Session:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.connection = inner.connection

    async def settle(self, s: Settlement) -> bool:
        raise StoreError("ConnectionDoesNotExistError: connection was closed")


async def test_a_jobs_fenced_settlement_that_failed_before_its_commit_is_not_sent_again(
    own_dsn: str,
) -> None:
    runs: list[str] = []
    async with FailFencedCommit(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:

        @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=60.0)
        async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
            runs.append(ref)
            conn = await job.fenced_connection()
            await conn.execute("SELECT 1")
            return {"paid": ref}

        with pytest.raises(StoreError):
            await asyncio.wait_for(payout(ref="m17"), BOUND)
        record = await store.get(RecordKey("", "payout", "m17"))
        assert record is not None
        assert record.state is State.UNKNOWN, record.state
        assert runs == ["m17"]
