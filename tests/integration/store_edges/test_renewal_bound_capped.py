"""A lease renewal whose statement hangs (a table lock held by DDL) fails within
RENEW_SECONDS (5 s) however long the lease, not within a third of it: on a 30 s lease (a
third: 10 s) the heartbeat learns of it and tries again after 5 s, with 25 s of the lease left,
and the hung statement's connection is replaced (renewals.py `bound`)."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.postgres.renewals import RENEW_SECONDS


async def test_a_hung_renewal_of_a_long_lease_fails_within_renew_seconds(db_dsn: str) -> None:
    key = RecordKey("t", "POST /payouts", uuid.uuid4().hex)
    other = await asyncpg.connect(db_dsn)
    try:
        async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False) as store:
            claimed = await store.claim_lease(
                key, b"f" * 32, retention_seconds=60, lease_seconds=30
            )
            assert isinstance(claimed, Claimed)
            assert await store.heartbeat(key, claimed.generation, 30)
            async with other.transaction():
                await other.execute("LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE")
                loop = asyncio.get_running_loop()
                started = loop.time()
                with pytest.raises(StoreError):
                    await asyncio.wait_for(
                        store.heartbeat(key, claimed.generation, 30), RENEW_SECONDS + 3
                    )
                assert loop.time() - started < RENEW_SECONDS + 2
    finally:
        await other.close()
