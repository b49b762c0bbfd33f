"""A statement the store prepared on a pooled connection dropped by someone else (an app sharing
the pool ran `DEALLOCATE ALL`, as a migration tool or a handler of an unguarded route may):
the store's own statement (lease mode's claim, a status read) meets "prepared statement ...
does not exist" once, empties asyncpg's cache of the connection and runs again (runner.alone),
instead of failing on that connection for good."""

from __future__ import annotations

import asyncpg

from idem_middleware import PostgresStore
from idem_middleware.store.base import RecordKey


async def test_the_stores_statements_dropped_from_a_shared_connection_are_prepared_again(
    db_dsn: str,
) -> None:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=1)
    try:
        store = PostgresStore(pool=pool, listen=False)
        key = RecordKey("tenant-a", "POST /x", "dropped-statements")
        assert await store.get(key) is None  # (`get` prepared and cached on the one connection)
        async with pool.acquire() as conn:  # the app's own use of the shared pool
            await conn.execute("DEALLOCATE ALL")
        for _ in range(3):  # every later read on that connection works
            assert await store.get(key) is None
    finally:
        await pool.close()
