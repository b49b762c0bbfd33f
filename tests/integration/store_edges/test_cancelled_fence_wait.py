"""A fence cancelled in its wait for the record's row lock (another session's fence holds it;
the waiter's client left, or a bound on its wait ran out): its connection is terminated, not
given back to the pool with the transaction open, whose reset asyncpg reports at ERROR
("Resetting connection with an active transaction"); the pool then works on."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey
from tests.apps import BOUND


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"])
async def test_a_fence_cancelled_in_its_lock_wait_leaves_no_open_transaction(
    db_dsn: str, fast_path: bool, caplog: pytest.LogCaptureFixture
) -> None:
    key = RecordKey("tenant-a", "POST /x", f"cancelled-fence-{fast_path}")
    caplog.set_level(logging.WARNING)
    locker = await asyncpg.connect(db_dsn)
    try:
        async with PostgresStore(
            dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path
        ) as store:
            claimed = await store.claim_lease(
                key, b"f" * 32, retention_seconds=60.0, lease_seconds=30.0
            )
            assert isinstance(claimed, Claimed)
            async with locker.transaction():
                await locker.execute(
                    "SELECT 1 FROM idem_requests WHERE idem_key = $1 FOR UPDATE", key.key
                )

                async def fence() -> None:
                    async with store.fenced(key, claimed.generation):
                        pass

                waiting = asyncio.create_task(fence())
                for _ in range(int(BOUND / 0.01)):  # until the fence waits on the row lock
                    if await locker.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database()"
                    ):
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("the fence never waited")
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
            async with store.fenced(key, claimed.generation) as held:  # the pool works on
                assert held.connection is not None
            await asyncio.sleep(0)  # (asyncpg reports through the loop's exception handler)
    finally:
        await locker.close()
    assert "active transaction" not in caplog.text
