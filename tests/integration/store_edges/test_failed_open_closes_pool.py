"""A store whose open is refused (a database not migrated, a role lacking a privilege, a pooler
in statement mode) closes the pool the open made: an app whose startup fails, and is started
again by its supervisor, left `min_size` connections open on the server at every attempt,
until `max_connections` refused everyone (store.py `_open`'s cleanup)."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ConfigurationError
from tests.conftest import dsn_for


async def test_a_refused_open_leaves_no_connection_open(admin_dsn: str) -> None:
    name = f"idem_unmigrated_{uuid.uuid4().hex[:10]}"
    app_name = f"idem_refused_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        store = PostgresStore(
            dsn=dsn_for(admin_dsn, name),
            min_size=2,
            max_size=4,
            application_name=app_name,
            listen=False,
        )
        with pytest.raises(ConfigurationError):
            await store.open()
        left = -1
        for _ in range(100):  # (a closed connection's backend ends just after: 5 s at most)
            left = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app_name
            )
            if left == 0:
                break
            await asyncio.sleep(0.05)
        assert left == 0
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
