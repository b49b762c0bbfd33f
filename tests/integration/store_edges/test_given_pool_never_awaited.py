"""A pool given to the store and never awaited (`asyncpg.create_pool(...)` without `await`),
where the store is never opened and the middleware's startup checks it (`check_given_pool`):
ConfigurationError naming the fix, as `open()` raises; not a warning that the schema "cannot be
checked now" and a 503 for every guarded request."""

from __future__ import annotations

import asyncpg
import pytest

from idem_middleware import ConfigurationError, PostgresStore


async def test_the_startup_check_refuses_a_given_pool_never_awaited(db_dsn: str) -> None:
    pool = asyncpg.create_pool(db_dsn, min_size=1, max_size=1)  # (never awaited)
    store = PostgresStore(pool=pool)
    with pytest.raises(ConfigurationError, match="never awaited"):
        await store.check_given_pool(lifespan=True)
    # (never initialised, it holds no connection to close)
