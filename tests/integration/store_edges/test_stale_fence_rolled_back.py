"""A fence refused for a stale generation (StaleGeneration) rolls its transaction back before
its connection goes back to the pool: the pool's reset never finds an open transaction, which
asyncpg reports at ERROR ("Resetting connection with an active transaction"), a line an
operator's alerting takes for a fault, at every stale executor's write."""

from __future__ import annotations

import asyncio
import logging

import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StaleGeneration
from idem_middleware.store.base import Claimed, RecordKey


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"])
async def test_a_stale_fence_leaves_no_open_transaction_to_the_pool(
    db_dsn: str, fast_path: bool, caplog: pytest.LogCaptureFixture
) -> None:
    key = RecordKey("tenant-a", "POST /x", f"stale-fence-{fast_path}")
    caplog.set_level(logging.WARNING)
    async with PostgresStore(
        dsn=db_dsn, min_size=1, max_size=1, listen=False, fast_path=fast_path
    ) as store:
        claimed = await store.claim_lease(
            key, b"f" * 32, retention_seconds=60.0, lease_seconds=30.0
        )
        assert isinstance(claimed, Claimed)
        with pytest.raises(StaleGeneration):
            async with store.fenced(key, claimed.generation + 1_000_000):
                pass
        async with store.pool.acquire() as conn:  # the same, only connection
            assert not conn.is_in_transaction()
            assert await conn.fetchval("SELECT 1") == 1
        await asyncio.sleep(0)  # (asyncpg reports through the loop's exception handler)
    assert "active transaction" not in caplog.text
