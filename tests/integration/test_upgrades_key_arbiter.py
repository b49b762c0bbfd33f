"""A schema whose migrations are recorded but whose `idem_requests` lost its primary key (dropped
by hand, or left out of a restore: pg_restore's post-data section creates it) opened a store
without complaint; then every lease-mode claim failed (`ON CONFLICT` found no index to name)
and every claim read the whole table. The store now refuses to open, naming the statement
that restores it; a unique index of another name on the same columns is enough."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.migrations import migrate
from tests.conftest import dsn_for

Altered = Callable[[str], Awaitable[str]]


@pytest.fixture
async def altered(pg_dsn: str) -> AsyncIterator[Altered]:
    """`await altered(sql)`: a new database, migrated, then `sql` run there; its DSN."""
    made: list[str] = []

    async def make(statements: str) -> str:
        name = f"idem_arbiter_{uuid.uuid4().hex[:10]}"
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        made.append(name)
        dsn = dsn_for(pg_dsn, name)
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
            await conn.execute(statements)
        finally:
            await conn.close()
        return dsn

    try:
        yield make
    finally:
        admin = await asyncpg.connect(pg_dsn)
        try:
            for name in made:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def test_a_dropped_primary_key_is_refused_at_open_with_the_statement_that_restores_it(
    altered: Altered,
) -> None:
    dsn = await altered("ALTER TABLE idem_requests DROP CONSTRAINT idem_requests_pkey")
    with pytest.raises(ConfigurationError, match="no primary key") as refused:
        await PostgresStore(dsn=dsn, listen=False).open()
    assert "PRIMARY KEY (tenant, operation, idem_key)" in str(refused.value)


async def test_a_rule_that_refuses_the_claims_insert_is_refused_at_open(altered: Altered) -> None:
    dsn = await altered("CREATE RULE audit AS ON UPDATE TO idem_requests DO ALSO NOTIFY audit")
    with pytest.raises(ConfigurationError, match="DROP RULE"):
        await PostgresStore(dsn=dsn, listen=False).open()


async def test_a_unique_index_of_another_name_on_the_key_serves(altered: Altered) -> None:
    dsn = await altered(
        "ALTER TABLE idem_requests DROP CONSTRAINT idem_requests_pkey;"
        "CREATE UNIQUE INDEX restored_key ON idem_requests (idem_key, tenant, operation)"
    )
    async with PostgresStore(dsn=dsn, listen=False) as store:
        claim = await store.claim_lease(
            RecordKey("t", "POST /x", "k"), b"f" * 32, retention_seconds=60, lease_seconds=30
        )
    assert isinstance(claim, Claimed)
