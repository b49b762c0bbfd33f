"""A lease renewal on the renewals' own connection that the server's `lock_timeout` cancels
(a table lock held by DDL, a `LOCK TABLE` of an operator's) is the store's StoreError naming
the lock_timeout, as every other statement of the store that waits for a lock is, not asyncpg's
LockNotAvailableError (renewals.py `_run`: `lock_waited`): the heartbeat counts a StoreError as
a renewal that failed, and tries again."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed, RecordKey


async def test_a_renewal_cancelled_by_lock_timeout_is_a_store_error(db_dsn: str) -> None:
    key = RecordKey("t", "POST /payouts", uuid.uuid4().hex)
    store = PostgresStore(
        dsn=db_dsn,
        min_size=1,
        max_size=2,
        listen=False,
        connect_kwargs={"server_settings": {"lock_timeout": "200"}},
    )
    other = await asyncpg.connect(db_dsn)
    try:
        async with store:
            claimed = await store.claim_lease(
                key, b"f" * 32, retention_seconds=60, lease_seconds=30
            )
            assert isinstance(claimed, Claimed)
            assert await store.heartbeat(key, claimed.generation, 30)  # (its own connection)
            assert store._renewals._conn is not None
            async with other.transaction():
                await other.execute("LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(StoreError, match="lock_timeout"):
                    await store.heartbeat(key, claimed.generation, 30)
            assert await store.heartbeat(key, claimed.generation, 30)
    finally:
        await other.close()
