"""The pytest plugin's `idem_clean_dsn` (and so `idem_store`) hands each test the library's
tables empty, `idem_waiters` included: a lease-mode wait left registered by one test (a waiter a
cancelled request never removed) was still there in the next, which then read waiters it never
made. The emptying is `pytest_databases.emptied`."""

from __future__ import annotations

import asyncpg

from idem_middleware.pytest_databases import emptied


async def test_emptied_leaves_no_registered_waiter(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute("INSERT INTO idem_waiters (token, waiter) VALUES ('left-over', 1)")
        await emptied(db_dsn, 10.0)
        assert await conn.fetchval("SELECT count(*) FROM idem_waiters") == 0
    finally:
        await conn.close()
