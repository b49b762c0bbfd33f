"""A pool given to the store keeps its own `reset`: the fast path's COMMIT carries the
connection's reset query (a round trip fewer) only for a pool of the store's own, whose reset is
the store's. On a given pool whose `reset` keeps the session's settings (an app's `init` that
SETs them once per connection), the reset sent with the COMMIT (asyncpg's RESET ALL) wiped
them for the connection's next user (store.py `_clean_releases`, None unless the reset is the
store's)."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey, State, StoredResponse


async def _init(conn: Any) -> None:
    await conn.execute("SET idem_test.flag = 'kept'")


async def _keep(conn: Any) -> None:  # (the app's reset: the session's settings stay)
    return None


async def test_a_given_pools_reset_is_not_replaced_by_the_fast_commits(db_dsn: str) -> None:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=1, init=_init, reset=_keep)
    try:
        async with PostgresStore(pool=pool, listen=False) as store:
            k = RecordKey("tenant-a", "POST /x", uuid.uuid4().hex)
            async with store.transaction(acquire_timeout=5.0) as session:
                claimed = await session.claim(
                    k, b"f" * 32, retention_seconds=60.0, wait_seconds=0.2
                )
                assert isinstance(claimed, Claimed)
                await session.finish(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
            async with pool.acquire() as conn:  # (the same connection: a pool of one)
                assert await conn.fetchval("SELECT current_setting('idem_test.flag')") == "kept"
    finally:
        await pool.close()
