"""A generation sequence behind the records' generations (restarted by hand; a failover to a
logical replica or a restore that did not carry its value) refuses the store's open, naming the
fix: it would hand generations out again, and fencing compares them for equality (a takeover
drew the generation a late executor held, and both committed), and a key reused after its
retention got an old epoch (the same downstream key for a new request)."""

from __future__ import annotations

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey

_FIX = "SELECT setval('idem_generation_seq', (SELECT max(generation) FROM idem_requests))"


async def _claim(db_dsn: str, name: str) -> Claimed:
    """A lease-mode claim of `name` on a store opened for it (the open's checks run first)."""
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
        key = RecordKey("t", "POST /payouts", name)
        claim = await store.claim_lease(key, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    return claim


@pytest.mark.parametrize("restart", ["RESTART", "RESTART WITH 2"])
async def test_a_sequence_behind_the_records_refuses_the_open(db_dsn: str, restart: str) -> None:
    admin = await asyncpg.connect(db_dsn)
    try:
        await admin.execute("TRUNCATE idem_requests; SELECT setval('idem_generation_seq', 100)")
        claim = await _claim(db_dsn, f"behind-{restart}")
        assert claim.generation > 2
        await admin.execute(f"ALTER SEQUENCE idem_generation_seq {restart}")
        with pytest.raises(ConfigurationError, match="idem_generation_seq is behind") as refused:
            async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False):
                pass
        assert _FIX in str(refused.value)
        assert f"a record holds {claim.generation}" in str(refused.value)
        await admin.execute(_FIX)
        assert (await _claim(db_dsn, "after-setval")).generation > claim.generation
    finally:
        await admin.execute("TRUNCATE idem_requests")
        await admin.close()


async def test_a_sequence_ahead_of_an_empty_table_opens(db_dsn: str) -> None:
    admin = await asyncpg.connect(db_dsn)
    try:
        await admin.execute("TRUNCATE idem_requests; ALTER SEQUENCE idem_generation_seq RESTART")
        async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
            assert store.pool is not None
    finally:
        await admin.close()


@pytest.mark.parametrize(
    "ahead",
    ["ALTER SEQUENCE idem_generation_seq RESTART WITH 1000000",
     "SELECT setval('idem_generation_seq', 1000000, false)"],
)  # fmt: skip
async def test_a_sequence_set_ahead_opens(db_dsn: str, ahead: str) -> None:
    """Set ahead with nothing drawn since (`is_called` false), its last value reads NULL, as a
    sequence never drawn from does: the check draws one instead (one generation lost)."""
    admin = await asyncpg.connect(db_dsn)
    try:
        await admin.execute("TRUNCATE idem_requests; SELECT setval('idem_generation_seq', 100)")
        await _claim(db_dsn, "ahead")
        await admin.execute(ahead)
        assert (
            await _claim(db_dsn, "after-ahead")
        ).generation > 1000000  # (one drawn by the check)
    finally:
        await admin.execute("TRUNCATE idem_requests")
        await admin.close()
