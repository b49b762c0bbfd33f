"""`migrate` under a database's or role's own session defaults: a stricter
`default_transaction_isolation`, and a `lock_timeout`, `statement_timeout` or
`transaction_timeout`. Several migrators run at once (an init container per app host) and wait
for each other on the migrators' advisory lock; none of these defaults may make one of them fail
(before: told to drop the idem_ tables, or cut short with a message naming no migration)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from idem_middleware import sql
from idem_middleware.errors import StoreError
from idem_middleware.store.migrations import _LOCK_ID, migrate, pending_versions
from tests.conftest import dsn_for
from tests.integration.test_migrations import _waiting_on

ALL_VERSIONS = [version for version, _, _ in sql.migrations()]

#: `await new(*settings, upto=N)`: a new database migrated to version N (none: empty), then
#: `ALTER DATABASE ... SET` each of `settings` (new sessions take them); its DSN.
NewDatabase = Callable[..., Awaitable[str]]


@pytest.fixture
async def new_database(pg_dsn: str) -> AsyncIterator[NewDatabase]:
    created: list[str] = []

    async def create(*settings: str, upto: int = 0) -> str:
        name = f"idem_miso_{uuid.uuid4().hex[:12]}"
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
            created.append(name)
            for setting in settings:
                await admin.execute(f'ALTER DATABASE "{name}" SET {setting}')
        finally:
            await admin.close()
        dsn = dsn_for(pg_dsn, name)
        if upto:
            conn = await asyncpg.connect(dsn)
            try:
                async with conn.transaction():  # as an older version of the library did
                    for version, migration, text in sql.migrations():
                        if version <= upto:
                            await conn.execute(text)
                            await conn.execute(
                                "INSERT INTO idem_schema_migrations VALUES ($1, $2)",
                                version,
                                migration,
                            )
            finally:
                await conn.close()
        return dsn

    try:
        yield create
    finally:
        admin = await asyncpg.connect(pg_dsn)
        try:
            for name in created:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def _counts(conn: asyncpg.Connection[Any]) -> list[tuple[int, int]]:
    rows = await conn.fetch(
        "SELECT version, count(*) AS n FROM idem_schema_migrations GROUP BY 1 ORDER BY 1"
    )
    return [(r["version"], r["n"]) for r in rows]


@pytest.mark.parametrize(
    ("isolation", "upto"),
    [("repeatable read", 0), ("serializable", 0), ("repeatable read", 5)],
    ids=["repeatable-read", "serializable", "repeatable-read-from-0005"],
)
async def test_concurrent_migrators_under_a_stricter_default_isolation_apply_once(
    new_database: NewDatabase, isolation: str, upto: int
) -> None:
    """Under REPEATABLE READ the second migrator's snapshot was taken before its wait for the
    first: it did not see what the first committed, applied it again, and was told the schema
    was "made some other way" and to drop the idem_ tables."""
    dsn = await new_database(f"default_transaction_isolation = '{isolation}'", upto=upto)
    blocker, first, second = [await asyncpg.connect(dsn) for _ in range(3)]
    try:
        assert await first.fetchval("SHOW default_transaction_isolation") == isolation
        # Hold the migrators' lock until both migrators wait on it: the second then runs after
        # the first committed, whatever the order they were scheduled in.
        await blocker.execute("SELECT pg_advisory_lock($1)", _LOCK_ID)
        both = asyncio.ensure_future(asyncio.gather(migrate(first), migrate(second)))
        try:
            await _waiting_on(blocker, "advisory", 2)
        finally:
            await blocker.execute("SELECT pg_advisory_unlock($1)", _LOCK_ID)
        results = await asyncio.wait_for(both, 30)
        pending = [v for v in ALL_VERSIONS if v > upto]
        assert sorted(results, key=len) == [[], pending]
        assert await _counts(blocker) == [(v, 1) for v in ALL_VERSIONS]
        assert await pending_versions(first) == []
    finally:
        for conn in (blocker, first, second):
            await conn.close()


#: A database's timeouts, each far shorter than the wait below.
TIMEOUTS = ["lock_timeout = '50ms'", "statement_timeout = '50ms'", "transaction_timeout = '100ms'"]


@pytest.mark.parametrize("bound", [5.0, None], ids=["bounded", "unbounded"])
@pytest.mark.parametrize("setting", TIMEOUTS, ids=lambda s: s.split(" ")[0])
async def test_a_timeout_of_the_database_does_not_cut_short_the_wait_for_another_migrator(
    new_database: NewDatabase, pg_dsn: str, setting: str, bound: float | None
) -> None:
    """The advisory lock was waited for under the session's own lock_timeout (or cancelled by
    its statement_timeout): the migrator failed saying "migration  waited more than 5 s" (no
    migration named, and not 5 s), or, with no bound, with a TypeError."""
    admin = await asyncpg.connect(pg_dsn)
    try:
        version = int(await admin.fetchval("SHOW server_version_num"))
        if version < 170000 and setting.startswith("transaction_timeout"):
            pytest.skip("transaction_timeout is PostgreSQL 17's")
    finally:
        await admin.close()
    dsn = await new_database(setting)
    blocker, migrator = [await asyncpg.connect(dsn) for _ in range(2)]
    try:
        await blocker.execute("SELECT pg_advisory_lock($1)", _LOCK_ID)  # another migrate
        running = asyncio.ensure_future(migrate(migrator, lock_timeout=bound))
        try:
            await _waiting_on(blocker, "advisory")
            await asyncio.sleep(0.3)  # past the database's timeout
            assert not running.done(), running.result()
        finally:
            await blocker.execute("SELECT pg_advisory_unlock($1)", _LOCK_ID)
        assert await asyncio.wait_for(running, 30) == ALL_VERSIONS
        assert await _counts(blocker) == [(v, 1) for v in ALL_VERSIONS]
    finally:
        await blocker.close()
        await migrator.close()


async def test_without_a_bound_a_migration_waits_for_a_table_past_the_databases_lock_timeout(
    new_database: NewDatabase,
) -> None:
    """`migrate(conn, lock_timeout=None)` waits for ever, as it says: the database's
    lock_timeout cut its wait for a table short (and the error was a TypeError)."""
    dsn = await new_database("lock_timeout = '50ms'", upto=4)
    handler, migrator = [await asyncpg.connect(dsn) for _ in range(2)]
    try:
        await handler.execute("BEGIN; SELECT count(*) FROM idem_requests")  # 0005 alters it
        running = asyncio.ensure_future(migrate(migrator, lock_timeout=None))
        try:
            await _waiting_on(handler, "relation")
            await asyncio.sleep(0.3)
            assert not running.done(), running.result()
        finally:
            await handler.execute("ROLLBACK")
        assert await asyncio.wait_for(running, 30) == [v for v in ALL_VERSIONS if v > 4]
    finally:
        await handler.close()
        await migrator.close()


async def test_a_wait_before_any_migration_is_reported_as_migrates(
    new_database: NewDatabase,
) -> None:
    """A lock timeout met reading idem_schema_migrations, before any migration was tried, said
    "migration  waited" (a name left empty)."""
    dsn = await new_database(upto=4)
    holder, migrator = [await asyncpg.connect(dsn) for _ in range(2)]
    try:
        await holder.execute("BEGIN; LOCK TABLE idem_schema_migrations")
        pid = await holder.fetchval("SELECT pg_backend_pid()")
        with pytest.raises(StoreError) as refused:
            await asyncio.wait_for(migrate(migrator, lock_timeout=0.1), 30)
        message = str(refused.value)
        assert message.startswith("migrate waited more than 0.1 s for a lock ("), message
        assert "nothing was applied" in message
        assert f"pid {pid} " in message
        await holder.execute("ROLLBACK")
        assert await pending_versions(migrator) == [v for v in ALL_VERSIONS if v > 4]
    finally:
        await holder.close()
        await migrator.close()
