"""The ordinary path's claim holds the key's claim lock whenever it writes the pending record.

Found by probing (PostgreSQL, `fast_path=False`, and every token claim): `_lock_key` takes no
lock when it sees a live record, and the record can be gone before the claim's INSERT (a
lease-mode execution's 4xx released it, a purge at its expiry). The INSERT then ran without the
lock: a second transactional claim of the key was granted too (two handlers of one key at once,
one of them rolled back at its commit), and a lease claim took the free lock and waited inside
PostgreSQL for the uncommitted row, its pooled connection held for the whole handler.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware import PostgresStore, RecordKey
from idem_middleware.errors import ClaimBusy
from idem_middleware.store import Claimed
from idem_middleware.store.postgres import sessions
from tests.apps import BOUND, blocked_by

KEY = RecordKey("tenant-a", "POST /payouts", "k1")
FP = b"f" * 32


@pytest.mark.parametrize("token", [False, True])
async def test_a_record_gone_after_the_lock_check_is_claimed_under_the_lock(
    pool: Any, monkeypatch: pytest.MonkeyPatch, token: bool
) -> None:
    ordinary = PostgresStore(pool=pool, fast_path=False, listen=False)
    other = PostgresStore(pool=pool, listen=False)
    lease = await other.claim_lease(KEY, FP, retention_seconds=60, lease_seconds=30)
    assert isinstance(lease, Claimed)
    checked = sessions.lock_key

    async def then_released(conn: Any, key: RecordKey, lock: int, seconds: float) -> None:
        await checked(conn, key, lock, seconds)  # sees the live lease record: takes no lock
        assert await other.release(key, lease.generation)  # the execution's 4xx, just then

    token_hash = None
    if token:
        from idem_middleware.context import token_hash as hashed

        token_hash = hashed(KEY.key)
        await pool.execute(
            "INSERT INTO idem_tokens (tenant, token_hash, operation, expires_at)"
            " VALUES ($1, $2, $3, now() + interval '1 minute')",
            KEY.tenant,
            token_hash,
            KEY.operation,
        )
    monkeypatch.setattr(sessions, "lock_key", then_released)
    async with ordinary.transaction(acquire_timeout=5) as tx:
        claimed = await tx.claim(
            KEY, FP, retention_seconds=60, wait_seconds=1, token_hash=token_hash
        )
        monkeypatch.setattr(sessions, "lock_key", checked)
        assert isinstance(claimed, Claimed), claimed
        # While its handler runs, the key is busy for every other claim, at once.
        async with other.transaction(acquire_timeout=5) as second:
            with pytest.raises(ClaimBusy):
                await asyncio.wait_for(
                    second.claim(KEY, FP, retention_seconds=60, wait_seconds=1), BOUND
                )
        with pytest.raises(ClaimBusy):
            await asyncio.wait_for(
                other.claim_lease(KEY, FP, retention_seconds=60, lease_seconds=30), BOUND
            )
        assert await blocked_by(pool, tx.connection) == 0  # (nobody waits for its claim)
        await tx.abandon()
