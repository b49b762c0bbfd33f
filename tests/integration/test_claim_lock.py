"""The claim lock the store computes itself (store/postgres/claim_lock.py) is the database's
`idem_key_lock`, bit for bit: a claim through either takes the same lock, so processes of an
older version (claiming through the SQL function during a rolling upgrade) and this one still
exclude each other."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ClaimBusy, StoreError
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.migrations import migrate
from idem_middleware.store.postgres.claim_lock import ClaimLocks
from tests.conftest import _fresh_database

TUPLES = [
    ("tenant-a", "POST /pay", "k"),
    ("José", "POST /accounts/{account_id}/credits", "東京-🙂"),
    ("", "", ""),
    ("a\x1fb", "c", "d"),  # length prefixes keep these two apart
    ("a", "b\x1fc", "d"),
    ("t" * 300, "POST /x", "~" * 255),
]

HELD = (
    "SELECT (classid::bigint << 32) | objid::bigint AS lock FROM pg_locks "
    "WHERE locktype = 'advisory' AND objsubid = 1 AND pid = pg_backend_pid()"
)


async def test_the_store_computes_the_lock_the_server_computes(pool: Any) -> None:
    locks = ClaimLocks()
    async with pool.acquire() as conn:
        await locks.load(conn)
        for parts in TUPLES:
            want = await conn.fetchval("SELECT idem_key_lock($1, $2, $3)", *parts)
            assert locks.of(RecordKey(*parts)) == want, parts
    assert len({locks.of(RecordKey(*parts)) for parts in TUPLES}) == len(TUPLES)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"])
async def test_a_claim_holds_the_lock_an_older_claimant_waits_on(
    pool: Any, fast_path: bool
) -> None:
    """A claim made by the store holds `idem_key_lock`'s lock; a process of an older version,
    claiming the same key through the three-argument function meanwhile, is told it is busy."""
    key = RecordKey("José", "POST /pay", "k-1")
    async with (
        PostgresStore(pool=pool, listen=False, fast_path=fast_path) as store,
        store.transaction(acquire_timeout=5) as session,
    ):
        claimed = await session.claim(key, b"f" * 32, retention_seconds=60, wait_seconds=1)
        assert isinstance(claimed, Claimed)
        held = [r["lock"] for r in await session.driver.fetch(HELD)]
        async with pool.acquire() as old, old.transaction():
            want = await old.fetchval("SELECT idem_key_lock($1, $2, $3)", *key)
            rows = await old.fetch("SELECT * FROM idem_claim_key($1, $2, $3)", *key)
        assert held == [want]
        assert [r[0] for r in rows] == [2, 2]  # "another transaction is claiming it"
        await session.rollback()


async def test_a_claim_made_by_an_older_version_keeps_this_one_out(pool: Any) -> None:
    key = RecordKey("tenant-a", "POST /pay", "k-2")
    async with (
        PostgresStore(pool=pool, listen=False) as store,
        pool.acquire() as old,
        old.transaction(),
    ):
        assert await old.fetch("SELECT * FROM idem_claim_key($1, $2, $3)", *key) == []
        async with store.transaction(acquire_timeout=5) as session:
            with pytest.raises(ClaimBusy):
                await session.claim(key, b"f" * 32, retention_seconds=60, wait_seconds=0.1)


async def test_a_database_without_its_lock_secret_is_refused_at_startup(pg_dsn: str) -> None:
    dsn = await _fresh_database(pg_dsn, "idem_test_no_lock_secret")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        await conn.execute("DELETE FROM idem_lock_secret")
    finally:
        await conn.close()
    store = PostgresStore(dsn=dsn, min_size=1, max_size=1, listen=False)
    with pytest.raises(StoreError, match=r"idem_lock_secret has no row") as refused:
        await store.open()
    await store.close()
    # The fix it names works (`migrate` made the row once, with its table, and would not again).
    assert "0004_keyed_claim_lock.sql" in str(refused.value)
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        assert await conn.fetchval("SELECT count(*) FROM idem_lock_secret") == 0
        migration = files("idem_middleware.sql").joinpath("migrations/0004_keyed_claim_lock.sql")
        insert = migration.read_text().split("INSERT INTO idem_lock_secret", 1)[1].split(";")[0]
        await conn.execute("INSERT INTO idem_lock_secret" + insert)
    finally:
        await conn.close()
    async with PostgresStore(dsn=dsn, min_size=1, max_size=1, listen=False) as store:
        assert store.pool is not None
