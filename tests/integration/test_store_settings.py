"""A store's `connect_kwargs={"server_settings": ...}` are the caller's settings beside the
store's `application_name`, not in its place. Found by probing: they replaced it, and the
store's connections were nameless in pg_stat_activity."""

from __future__ import annotations

from idem_middleware.store.postgres import PostgresStore


async def test_server_settings_keep_the_stores_name(db_dsn: str) -> None:
    settings = {"server_settings": {"search_path": "public", "lock_timeout": "7s"}}
    async with PostgresStore(dsn=db_dsn, connect_kwargs=settings, listen=False) as store:
        assert await store.pool.fetchval("SHOW application_name") == "idem_middleware"
        assert await store.pool.fetchval("SHOW lock_timeout") == "7s"
    named = {"server_settings": {"application_name": "billing"}}
    async with PostgresStore(dsn=db_dsn, connect_kwargs=named, listen=False) as store:
        assert await store.pool.fetchval("SHOW application_name") == "billing"
