"""A lease-mode claim whose statement waited for a lock on the table (a migration's `ALTER
TABLE`, a `CREATE INDEX` without `CONCURRENTLY`) gets its whole lease from when it wrote the
record, not from when its statement began: counted from the start, it arrived with its lease
already lapsed, and a duplicate took the record over (`LeaseExpiry.TAKEOVER`) or marked it
`unknown` as its handler began. The fresh claim and the one-time token's claim alike (the reclaim of
an expired record writes its lease the same way; its statement follows a claim's that found the
record, so no lock can be made to come between them here)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from idem_middleware import PostgresStore
from idem_middleware.keys import token_hash
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.tokens import TokenIssuer

LEASE = 30.0
KEY = RecordKey("tenant-a", "POST /payouts", "k-1")


async def claimed_behind_a_table_lock(
    store: PostgresStore, pool: Any, token: bytes | None = None
) -> float:
    """Claim KEY while another session holds `SHARE` on the table (as `CREATE INDEX` does);
    the claim waits for it. Returns the lease the record got past the moment the lock was let
    go (a whole lease or more: counted from when the claim wrote it)."""
    claiming = store.claim_lease(
        KEY, b"fp", retention_seconds=60, lease_seconds=LEASE, token_hash=token
    )
    return await behind_a_table_lock(pool, claiming, Claimed)


async def behind_a_table_lock(pool: Any, statement: Any, answer: Any) -> float:
    """Run `statement` (a coroutine) while the table is locked, and see it answer an instance
    of `answer`; the lease past the moment the lock went."""
    locker: asyncpg.Connection[Any] = await pool.acquire()
    try:
        await locker.execute("BEGIN; LOCK TABLE idem_requests IN SHARE MODE")
        claim = asyncio.create_task(statement)
        for _ in range(500):  # until the claim waits for the lock (bounded: 5 s)
            waiting = await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            )
            if waiting:
                break
            await asyncio.sleep(0.01)
        assert waiting, "the claim never waited for the table lock"
        await asyncio.sleep(0.3)  # (the claim's statement began this long before the lock went)
        released = await locker.fetchval("SELECT clock_timestamp()")
        await locker.execute("COMMIT")
        assert isinstance(await claim, answer)
    finally:
        await pool.release(locker)
    left = await pool.fetchval(
        "SELECT extract(epoch FROM lease_expires_at - $1::timestamptz) FROM idem_requests",
        released,
    )
    return float(left)


async def test_a_fresh_claim_gets_its_whole_lease(pg_store: PostgresStore, pool: Any) -> None:
    assert await claimed_behind_a_table_lock(pg_store, pool) >= LEASE


async def test_a_token_claim_gets_its_whole_lease(pg_store: PostgresStore, pool: Any) -> None:
    issued = await TokenIssuer(pg_store, secret=b"s" * 32).issue("tenant-a", KEY.operation)
    left = await claimed_behind_a_table_lock(pg_store, pool, token_hash(issued.token))
    assert left >= LEASE


async def test_a_renewal_gets_its_whole_lease(pg_store: PostgresStore, pool: Any) -> None:
    claim = await pg_store.claim_lease(KEY, b"fp", retention_seconds=60, lease_seconds=LEASE)
    assert isinstance(claim, Claimed)
    renewing = pg_store.heartbeat(KEY, claim.generation, LEASE)
    assert await behind_a_table_lock(pool, renewing, bool) >= LEASE
