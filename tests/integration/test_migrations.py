"""The numbered migrations, schema.sql and the named queries agree with each other and the code."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore, sql
from idem_middleware.errors import ConfigurationError, StoreError
from idem_middleware.inbox import purge_inbox
from idem_middleware.store.base import RecordKey
from idem_middleware.store.migrations import _LOCK_ID, migrate, pending_versions
from tests.conftest import dsn_for

PACKAGE = Path(sql.__file__).resolve().parent.parent
QUERIES_FILE = Path(sql.__file__).resolve().parent / "queries.sql"
ALL_VERSIONS = [version for version, _, _ in sql.migrations()]

NewDatabase = Callable[[], Awaitable[str]]


@pytest.fixture
async def new_database(pg_dsn: str) -> AsyncIterator[NewDatabase]:
    """Creates empty databases on the test server; drops them all afterwards."""
    created: list[str] = []

    async def create() -> str:
        name = f"idem_mig_{uuid.uuid4().hex[:12]}"
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        created.append(name)
        return dsn_for(pg_dsn, name)

    try:
        yield create
    finally:
        admin = await asyncpg.connect(pg_dsn)
        try:
            for name in created:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def _snapshot(conn: asyncpg.Connection[Any]) -> dict[str, list[tuple[Any, ...]]]:
    """Everything in the public schema a migration could create, as comparable rows."""
    queries = {
        "relations": """
            SELECT c.relname, c.relkind::text, c.relpersistence::text
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = 'public' ORDER BY 1""",
        "columns": """
            SELECT table_name, column_name, ordinal_position, data_type, udt_name,
                   column_default, is_nullable, character_maximum_length, numeric_precision,
                   datetime_precision, interval_type, is_identity, is_generated,
                   generation_expression, collation_name
            FROM information_schema.columns
            WHERE table_schema = 'public' ORDER BY table_name, ordinal_position""",
        "constraints": """
            SELECT c.relname, co.conname, co.contype::text, pg_get_constraintdef(co.oid),
                   co.condeferrable, co.condeferred
            FROM pg_constraint co
            JOIN pg_class c ON c.oid = co.conrelid
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = 'public' ORDER BY 1, 2""",
        "indexes": """
            SELECT tablename, indexname, indexdef FROM pg_indexes
            WHERE schemaname = 'public' ORDER BY 1, 2""",
        "sequences": """
            SELECT sequencename, data_type::text, start_value, min_value, max_value,
                   increment_by, cycle, cache_size
            FROM pg_sequences WHERE schemaname = 'public' ORDER BY 1""",
        "triggers": """
            SELECT t.tgname, pg_get_triggerdef(t.oid)
            FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = 'public' AND NOT t.tgisinternal ORDER BY 1""",
        "functions": """
            SELECT p.proname, pg_get_function_identity_arguments(p.oid), p.prokind::text,
                   CASE WHEN p.prokind IN ('f', 'p') THEN pg_get_functiondef(p.oid) END
            FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'public' ORDER BY 1, 2""",
        "types": """
            SELECT t.typname, t.typtype::text FROM pg_type t
            JOIN pg_namespace n ON n.oid = t.typnamespace
            WHERE n.nspname = 'public' AND t.typtype IN ('e', 'd', 'c')
              AND NOT EXISTS (SELECT FROM pg_class c WHERE c.reltype = t.oid)
            ORDER BY 1""",
    }
    return {name: [tuple(r) for r in await conn.fetch(q)] for name, q in queries.items()}


async def test_migrations_build_exactly_schema_sql(new_database: NewDatabase) -> None:
    migrated_dsn, declared_dsn = await new_database(), await new_database()
    migrated = await asyncpg.connect(migrated_dsn)
    declared = await asyncpg.connect(declared_dsn)
    try:
        assert await migrate(migrated) == ALL_VERSIONS
        await declared.execute(sql.schema_sql())

        got, want = await _snapshot(migrated), await _snapshot(declared)
        relations = {row[0] for row in want["relations"]}
        assert {"idem_requests", "idem_generation_seq", "idem_schema_migrations"} <= relations
        for part in ("columns", "constraints", "indexes", "sequences"):
            assert want[part], f"the schema.sql snapshot has no {part}"
        for part in want:
            assert got[part] == want[part], f"migrations and schema.sql differ in {part}"

        # The migrations table is in both; only the migrated database records versions.
        migrated_versions = await migrated.fetch(
            "SELECT version FROM idem_schema_migrations ORDER BY version"
        )
        assert [r["version"] for r in migrated_versions] == ALL_VERSIONS
        assert await declared.fetchval("SELECT count(*) FROM idem_schema_migrations") == 0
    finally:
        await migrated.close()
        await declared.close()


async def test_migrate_is_idempotent_and_safe_to_run_concurrently(
    new_database: NewDatabase,
) -> None:
    dsn = await new_database()
    blocker = await asyncpg.connect(dsn)
    first = await asyncpg.connect(dsn)
    second = await asyncpg.connect(dsn)
    try:
        assert await pending_versions(first) == ALL_VERSIONS
        # Hold the migrators' lock so both are provably inside migrate() at the same time.
        await blocker.execute("SELECT pg_advisory_lock($1)", _LOCK_ID)
        both = asyncio.ensure_future(asyncio.gather(migrate(first), migrate(second)))
        try:
            for _ in range(500):
                waiting = await blocker.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
                )
                if waiting == 2:
                    break
                assert not both.done(), "a migrator did not wait for the lock"
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the two migrators never both waited on the lock")
        finally:
            await blocker.execute("SELECT pg_advisory_unlock($1)", _LOCK_ID)
        results = await asyncio.wait_for(both, 30)
        assert sorted(results, key=len) == [[], ALL_VERSIONS]

        counts = await blocker.fetch(
            "SELECT version, count(*) AS n FROM idem_schema_migrations GROUP BY version"
            " ORDER BY version"
        )
        assert [(r["version"], r["n"]) for r in counts] == [(v, 1) for v in ALL_VERSIONS]

        # A third run applies nothing and changes nothing.
        before = await _snapshot(blocker)
        assert await migrate(first) == []
        assert await pending_versions(first) == []
        assert await _snapshot(blocker) == before
        assert await blocker.fetchval("SELECT count(*) FROM idem_schema_migrations") == len(
            ALL_VERSIONS
        )
    finally:
        for conn in (blocker, first, second):
            await conn.close()


async def _waiting_on(conn: asyncpg.Connection[Any], event: str, count: int = 1) -> None:
    """Until `count` sessions of this database wait on a lock of this kind (bounded)."""
    for _ in range(500):
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND wait_event = $1",
            event,
        )
        if waiting >= count:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"no session waited on a lock of kind {event}")


async def test_a_migration_gives_up_on_a_table_lock_instead_of_stalling_every_request(
    new_database: NewDatabase,
) -> None:
    """Migration 0005 alters idem_requests. A transaction that read the table (a transactional
    handler mid-run, of the version being upgraded) kept it waiting, and every request's read
    queued behind it, for as long as that transaction lasted: without end for one left idle.
    It now gives up after its lock timeout, applies nothing and names the session; once that
    is over, migrate applies everything."""
    dsn = await new_database()
    migrator = await asyncpg.connect(dsn)
    handler = await asyncpg.connect(dsn)
    try:
        async with migrator.transaction():  # the database of a version at 0004
            for version, name, text in sql.migrations():
                if version <= 4:
                    await migrator.execute(text)
                    await migrator.execute(
                        "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)",
                        version,
                        name,
                    )
        await handler.execute("BEGIN; SELECT count(*) FROM idem_requests")
        pid = await handler.fetchval("SELECT pg_backend_pid()")

        with pytest.raises(StoreError) as refused:
            await asyncio.wait_for(migrate(migrator, lock_timeout=0.2), 30)
        message = str(refused.value)
        assert "0005_epoch_and_consumed_tokens" in message
        assert f"pid {pid} " in message
        assert "idle in transaction" in message
        assert "nothing was applied" in message
        assert "--lock-timeout" in message
        assert await pending_versions(migrator) == [v for v in ALL_VERSIONS if v > 4]
        # The transaction goes on (its lock was never taken from it).
        assert await handler.fetchval("SELECT count(*) FROM idem_requests") == 0

        await handler.execute("ROLLBACK")
        assert await migrate(migrator, lock_timeout=0.2) == [v for v in ALL_VERSIONS if v > 4]
    finally:
        await migrator.close()
        await handler.close()


async def test_the_lock_timeout_does_not_cut_short_the_wait_for_another_migrator(
    new_database: NewDatabase,
) -> None:
    dsn = await new_database()
    blocker = await asyncpg.connect(dsn)
    migrator = await asyncpg.connect(dsn)
    try:
        await blocker.execute("SELECT pg_advisory_lock($1)", _LOCK_ID)  # another migrate
        running = asyncio.ensure_future(migrate(migrator, lock_timeout=0.05))
        try:
            await _waiting_on(blocker, "advisory")
            await asyncio.sleep(0.2)  # past its lock timeout
            assert not running.done()
        finally:
            await blocker.execute("SELECT pg_advisory_unlock($1)", _LOCK_ID)
        assert await asyncio.wait_for(running, 30) == ALL_VERSIONS
    finally:
        await blocker.close()
        await migrator.close()


# --- the named queries --------------------------------------------------------------------------

_USE = re.compile(r"""(?:\b_Q|\bqueries\(\))\[\s*["'](\w+)["']\s*\]""")
_DYNAMIC_USE = re.compile(r"""(?:\b_Q|\bqueries\(\))(?:\[\s*[^"'\s]|\.get\()""")


def _code_files() -> list[Path]:
    files = sorted(p for p in PACKAGE.rglob("*.py") if p.parent.name != "__pycache__")
    assert files
    return files


def test_every_query_the_code_uses_exists_and_none_is_dead() -> None:
    used: dict[str, list[str]] = {}
    for path in _code_files():
        text = path.read_text()
        dynamic = _DYNAMIC_USE.search(text)
        assert dynamic is None, (
            f"{path.name} looks a query up by a computed name ({dynamic.group(0)!r}); "
            "use a literal name so this test can see it"
        )
        for name in _USE.findall(text):
            used.setdefault(name, []).append(path.name)
    defined = set(sql.queries())
    assert used, "no query use found: the pattern is out of date"
    missing = {name: where for name, where in used.items() if name not in defined}
    assert not missing, f"the code uses queries queries.sql does not define: {missing}"
    dead = defined - set(used)
    assert not dead, f"queries.sql defines queries no code uses: {sorted(dead)}"


def _query_blocks() -> dict[str, tuple[list[str], list[str]]]:
    """{name: (header comment lines, sql lines)} straight from queries.sql."""
    parts = re.split(r"^-- name: (\w+)\s*$", QUERIES_FILE.read_text(), flags=re.MULTILINE)
    blocks: dict[str, tuple[list[str], list[str]]] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.strip().splitlines() if line.strip()]
        header: list[str] = []
        for line in lines:
            if not line.lstrip().startswith("--"):
                break
            header.append(line)
        code = [line for line in lines if not line.lstrip().startswith("--")]
        blocks[name] = (header, code)
    assert set(blocks) == set(sql.queries())
    return blocks


def _params(lines: list[str]) -> set[int]:
    return {int(n) for line in lines for n in re.findall(r"\$(\d+)", line)}


def test_every_query_documents_its_parameters() -> None:
    for name, (header, code) in _query_blocks().items():
        used, documented = _params(code), _params(header)
        assert used == documented, (
            f"query {name!r}: the SQL uses ${sorted(used)}, the header names ${sorted(documented)}"
        )
        assert used == set(range(1, len(used) + 1)), f"query {name!r} skips a parameter: {used}"


async def test_every_query_prepares_with_its_documented_parameters(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        for name, (_, code) in _query_blocks().items():
            statement = await conn.prepare(sql.queries()[name])
            assert len(statement.get_parameters()) == max(_params(code), default=0), name
    finally:
        await conn.close()


# --- the installation's lock secret (migration 0004) --------------------------------------------


async def test_each_installation_gets_its_own_lock_secret(new_database: NewDatabase) -> None:
    secrets = []
    for build in ("migrations", "migrations", "schema.sql"):
        conn = await asyncpg.connect(await new_database())
        try:
            if build == "migrations":
                await migrate(conn)
            else:
                await conn.execute(sql.schema_sql())
            [row] = await conn.fetch("SELECT inner_key, outer_key FROM idem_lock_secret")
            lock = await conn.fetchval("SELECT idem_key_lock('t', 'POST /x', 'k')")
        finally:
            await conn.close()
        inner, outer = bytes(row["inner_key"]), bytes(row["outer_key"])
        secret = bytes(b ^ 0x36 for b in inner)
        assert bytes(b ^ 0x5C for b in outer) == secret  # HMAC's two pads of one secret
        assert len(secret) == 64
        secrets.append((secret, lock))
    assert len({s for s, _ in secrets}) == 3
    assert len({lock for _, lock in secrets}) == 3  # the same key locks differently in each


# --- opening a store checks the schema (issue 15) -----------------------------------------------


async def _apply_up_to(conn: asyncpg.Connection[Any], last: int) -> None:
    """Apply migrations 1..last by hand, as an older version of the library would have."""
    async with conn.transaction():
        for version, name, text in sql.migrations():
            if version <= last:
                await conn.execute(text)
                await conn.execute(
                    "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)",
                    version,
                    name,
                )


@pytest.mark.parametrize("applied", [0, 3], ids=["never-migrated", "one-migration-behind"])
async def test_opening_a_store_on_an_unmigrated_database_names_the_command(
    new_database: NewDatabase, applied: int
) -> None:
    dsn = await new_database()
    conn = await asyncpg.connect(dsn)
    try:
        await _apply_up_to(conn, applied)
        missing = [f"{v:04d}_{n}" for v, n, _ in sql.migrations() if v > applied]
        with pytest.raises(ConfigurationError) as own:
            await PostgresStore(dsn=dsn, application_name="idem_unmigrated").open()
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        try:
            store = PostgresStore(pool=pool)
            with pytest.raises(ConfigurationError) as borrowed:
                await store.open()
            assert not pool._closed  # a borrowed pool is the caller's to close
        finally:
            await pool.close()
        # The store closed the pool it had created.
        left = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idem_unmigrated'"
        )
        assert left == 0
        for error in (own.value, borrowed.value):
            assert "idem-middleware" in str(error)
            assert "migrate" in str(error)
            assert ", ".join(missing) in str(error)
        await migrate(conn)
        async with PostgresStore(dsn=dsn) as store:
            assert await store.get(RecordKey("t", "POST /x", "k")) is None
    finally:
        await conn.close()


@pytest.mark.parametrize("schema", ["Idem", "idem store", 'a"b'])
async def test_migrate_into_a_schema_whose_name_needs_quoting(
    new_database: NewDatabase, schema: str
) -> None:
    """The migrations table is looked up by the schema's name: `current_schema()::regnamespace`
    parsed the name as an identifier, so `Idem` was looked for as `idem` ("does not exist") and
    `idem store` was "invalid name syntax": neither migrate nor a store could start there."""
    dsn = await new_database()
    quoted = '"' + schema.replace('"', '""') + '"'
    settings = {"search_path": quoted}
    conn = await asyncpg.connect(dsn, server_settings=settings)
    try:
        await conn.execute(f"CREATE SCHEMA {quoted}")
        assert await pending_versions(conn) == ALL_VERSIONS
        assert await migrate(conn) == ALL_VERSIONS
        assert await migrate(conn) == []
        assert await pending_versions(conn) == []
        assert await conn.fetchval(
            "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idem_requests'",
            schema,
        )
    finally:
        await conn.close()
    async with PostgresStore(dsn=dsn, connect_kwargs={"server_settings": settings}) as store:
        assert await store.get(RecordKey("t", "POST /x", "k")) is None


async def test_opening_a_store_on_read_only_sessions_names_the_fix(
    new_database: NewDatabase,
) -> None:
    """A role or database whose sessions default to read-only: every guarded request failed
    with a 500 when it wrote its record; now the store refuses to open and says why. The
    command line's reports still run there."""
    from tests.integration.test_cli import cli

    dsn = await new_database()
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        name = await conn.fetchval("SELECT current_database()")
        await conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    finally:
        await conn.close()
    with pytest.raises(ConfigurationError, match="default_transaction_read_only"):
        await PostgresStore(dsn=dsn).open()
    writable = {"server_settings": {"default_transaction_read_only": "off"}}
    async with PostgresStore(dsn=dsn, connect_kwargs=writable) as store:
        assert await store.get(RecordKey("t", "POST /x", "k")) is None
    stats = cli("stats", dsn=dsn)
    assert stats.returncode == 0, stats.stderr


async def test_a_store_whose_checks_the_server_cancels_at_open_is_a_store_error(
    new_database: NewDatabase,
) -> None:
    """`statement_timeout` on the database shorter than the store's checks at open (here made
    certain: the migrations' table is locked meanwhile): the server's cancellation escaped as
    asyncpg's own error; it is a StoreError that names the likely setting."""
    dsn = await new_database()
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        name = await conn.fetchval("SELECT current_database()")
        await conn.execute(f'ALTER DATABASE "{name}" SET statement_timeout = 200')
        async with conn.transaction():
            await conn.execute("LOCK TABLE idem_schema_migrations IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(StoreError, match="statement_timeout"):
                await asyncio.wait_for(PostgresStore(dsn=dsn).open(), 30)  # (a hang bound)
    finally:
        await conn.close()


async def test_a_role_the_server_refuses_a_login_is_a_store_error_that_cannot_connect(
    pg_dsn: str, new_database: NewDatabase
) -> None:
    """A role disabled (NOLOGIN) or a password rotated: the server's refusal escaped as
    asyncpg's own error (at a request: a bare 500, not a 503)."""
    from urllib.parse import urlsplit, urlunsplit

    dsn = await new_database()
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute("DROP ROLE IF EXISTS idem_no_login")
        await admin.execute("CREATE ROLE idem_no_login NOLOGIN")
        parts = urlsplit(dsn)
        refused = urlunsplit(parts._replace(netloc="idem_no_login@" + parts.netloc.split("@")[-1]))
        with pytest.raises(StoreError, match="cannot connect"):
            await PostgresStore(dsn=refused).open()
    finally:
        await admin.execute("DROP ROLE IF EXISTS idem_no_login")
        await admin.close()


async def test_the_outbox_purge_index_built_concurrently_beforehand_is_kept(
    new_database: NewDatabase,
) -> None:
    """docs/operating.md: on a large outbox, build 0009's index by hand with CREATE INDEX
    CONCURRENTLY first; the migration then keeps it rather than refusing to run."""
    conn = await asyncpg.connect(await new_database())
    try:
        await migrate(conn)
        await conn.execute("DROP INDEX idem_outbox_sent_idx")
        await conn.execute("DELETE FROM idem_schema_migrations WHERE version = 9")
        await conn.execute(
            "CREATE INDEX CONCURRENTLY idem_outbox_sent_idx ON idem_outbox (sent_at)"
            " WHERE sent_at IS NOT NULL"
        )
        assert await migrate(conn) == [9]
        count = "SELECT count(*) FROM pg_indexes WHERE indexname = 'idem_outbox_sent_idx'"
        assert await conn.fetchval(count) == 1
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("version", "index", "rows"),
    [
        (
            9,
            "idem_outbox_sent_idx",
            "INSERT INTO idem_outbox (event_id, topic, payload, sent_at)"
            " VALUES ('a', 't', '{}', now()), ('b', 't', '{}', now())",
        ),
        (
            10,
            "idem_inbox_received_idx",
            "INSERT INTO idem_inbox (consumer, event_id, received_at)"
            " VALUES ('c', 'a', now()), ('c', 'b', now())",
        ),
    ],
    ids=["outbox", "inbox"],
)
async def test_an_index_built_beforehand_that_did_not_finish_is_built_again(
    new_database: NewDatabase, version: int, index: str, rows: str
) -> None:
    """Found by probing: a CREATE INDEX CONCURRENTLY of the migration's index, by hand, that
    failed or was cancelled leaves an invalid index of its name; the migration's `IF NOT EXISTS`
    kept it, recorded itself applied, and purge went on reading the whole table."""
    conn = await asyncpg.connect(await new_database())
    try:
        await migrate(conn)
        await conn.execute(f"DROP INDEX {index}")
        await conn.execute("DELETE FROM idem_schema_migrations WHERE version = $1", version)
        await conn.execute(rows)
        table = index.removesuffix("_sent_idx").removesuffix("_received_idx")
        column = "topic" if version == 9 else "consumer"
        with pytest.raises(asyncpg.UniqueViolationError):  # (the build fails: left invalid)
            await conn.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {index} ON {table} ({column})")
        valid = f"SELECT indisvalid FROM pg_index WHERE indexrelid = '{index}'::regclass"
        assert await conn.fetchval(valid) is False
        assert await migrate(conn) == [version]
        assert await conn.fetchval(valid) is True
        definition = f"SELECT indexdef FROM pg_indexes WHERE indexname = '{index}'"
        assert "UNIQUE" not in await conn.fetchval(definition)
    finally:
        await conn.close()


async def test_an_unfinished_index_of_another_schemas_installation_is_left_alone(
    new_database: NewDatabase,
) -> None:
    """Found in review: the invalid index was looked up and dropped by its bare name, through
    the search path: migrating a schema first on the path dropped another installation's."""
    dsn = await new_database()
    mine = {"search_path": '"Idem X", public'}
    conn = await asyncpg.connect(dsn, server_settings={"search_path": '"Idem X"'})
    try:
        await conn.execute('CREATE SCHEMA "Idem X"')
        assert await migrate(conn) == ALL_VERSIONS
        await conn.execute("DROP INDEX idem_outbox_sent_idx")
        await conn.execute("DELETE FROM idem_schema_migrations WHERE version = 9")
    finally:
        await conn.close()
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)  # (another installation, in public)
        await conn.execute("DROP INDEX idem_outbox_sent_idx")
        await conn.execute(
            "INSERT INTO idem_outbox (event_id, topic, payload, sent_at)"
            " VALUES ('a', 't', '{}', now()), ('b', 't', '{}', now())"
        )
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.execute(
                "CREATE UNIQUE INDEX CONCURRENTLY idem_outbox_sent_idx ON idem_outbox (topic)"
            )
    finally:
        await conn.close()
    conn = await asyncpg.connect(dsn, server_settings=mine)
    try:
        assert await migrate(conn) == [9]
        valid = await conn.fetch(
            "SELECT n.nspname, i.indisvalid FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relname = 'idem_outbox_sent_idx' ORDER BY 1"
        )
        assert [tuple(row) for row in valid] == [("Idem X", True), ("public", False)]
    finally:
        await conn.close()


async def test_a_database_a_newer_version_migrated_is_served_by_this_one(
    new_database: NewDatabase,
) -> None:
    """A rolling upgrade, or a rollback: the newer version's `migrate` recorded a migration this
    version does not know. This version's store opens and serves, and its `migrate` applies
    nothing (it never undoes or re-runs what a newer version did)."""
    dsn = await new_database()
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        newer = max(v for v, _, _ in sql.migrations()) + 1
        await conn.execute(
            "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)",
            newer,
            "from_a_newer_version",
        )
        assert await pending_versions(conn) == []
        assert await migrate(conn) == []
        async with PostgresStore(dsn=dsn) as store:
            assert await store.get(RecordKey("t", "POST /x", "k")) is None
        recorded = await conn.fetchval("SELECT max(version) FROM idem_schema_migrations")
        assert recorded == newer
    finally:
        await conn.close()


async def test_inbox_rows_recorded_before_0010_are_purged_and_its_index_built_beforehand_kept(
    new_database: NewDatabase,
) -> None:
    """0010 indexes `idem_inbox.received_at` for `inbox purge`; rows recorded before it have
    their time already and are purged by age, and an index built by hand first is kept."""
    dsn = await new_database()
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        await conn.execute("DROP INDEX idem_inbox_received_idx")
        await conn.execute("DELETE FROM idem_schema_migrations WHERE version = 10")
        await conn.execute(
            "INSERT INTO idem_inbox (consumer, event_id, received_at)"
            " VALUES ('c', 'old', now() - interval '2 days'), ('c', 'new', now())"
        )
        await conn.execute(
            "CREATE INDEX CONCURRENTLY idem_inbox_received_idx ON idem_inbox (received_at)"
        )
        assert await migrate(conn) == [10]
        count = "SELECT count(*) FROM pg_indexes WHERE indexname = 'idem_inbox_received_idx'"
        assert await conn.fetchval(count) == 1
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        try:
            assert await purge_inbox(pool, older_than_seconds=86400) == 1
        finally:
            await pool.close()
        assert await conn.fetchval("SELECT array_agg(event_id) FROM idem_inbox") == ["new"]
    finally:
        await conn.close()


async def test_a_migration_refused_to_a_role_that_does_not_own_the_tables_says_the_owner(
    new_database: NewDatabase,
) -> None:
    """Found by probing: the refusal advised a role "that may create in its schema" as well as
    the owner, and such a role is refused again: 0011 alters a table, which only its owner may."""
    dsn = await new_database()
    conn = await asyncpg.connect(dsn)
    role = f"idem_mig_creator_{uuid.uuid4().hex[:8]}"
    try:
        await migrate(conn)
        await conn.execute("ALTER TABLE idem_requests DROP COLUMN reopened_generation")
        await conn.execute("DELETE FROM idem_schema_migrations WHERE version = 11")
        await conn.execute(f"CREATE ROLE {role} LOGIN")
        await conn.execute(f"GRANT CREATE, USAGE ON SCHEMA public TO {role}")
        await conn.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
        await conn.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
        await conn.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO {role}")
        creator = await asyncpg.connect(dsn, user=role)
        try:
            with pytest.raises(ConfigurationError, match="migration 0011") as refused:
                await migrate(creator)
        finally:
            await creator.close()
        assert "only their owner may alter or index them" in str(refused.value)
        assert "one that may create in its schema" not in str(refused.value)
    finally:
        await conn.execute(f"DROP OWNED BY {role}")
        await conn.execute(f"DROP ROLE IF EXISTS {role}")
        await conn.close()
