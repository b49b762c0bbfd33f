"""A store closed and opened again (an app whose lifespan runs twice, a test fixture reused)
renews leases on a connection of its own again, not on the pool: the close stops the renewals'
connection and the next open resumes it (renewals.py `resume`). Left stopped, every renewal
waited for a pool connection, and one that found none for a whole lease (a pool of one held by
the handler) lost the lease: another process could run the handler again."""

from __future__ import annotations

from typing import Any

import asyncpg

from idem_middleware import PostgresStore
from tests.integration.test_renewals import KEY, _claim


async def test_renewals_take_their_own_connection_again_after_a_reopen(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False)
    async with store:
        pass
    async with store:
        generation = await _claim(store)
        async with store.pool.acquire():  # (the pool's only connection, held: as a handler's)
            assert await store.heartbeat(KEY, generation, 30)
        assert store._renewals._conn is not None
