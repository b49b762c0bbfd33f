"""What the store's role may do, and a schema that is not what its migrations table says.

A role that cannot write the store's tables, draw generations, call `idem_claim_key` or take an
advisory lock opened a store without complaint and then failed every guarded request with a
500; a role without USAGE on the schema was told its migrated database lacked every migration;
one that cannot read `idem_schema_migrations` got asyncpg's error. Each is now a
ConfigurationError when the store opens, naming the statements that fix it, and running them
is enough. `migrate` run as a role that may not create or alter the objects, or over objects
made some other way, says so instead of passing the server's error on alone.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from idem_middleware import PostgresStore, sql
from idem_middleware.errors import ConfigurationError
from idem_middleware.store.base import RecordKey
from idem_middleware.store.migrations import migrate
from tests.apps import BOUND, Held, assert_problem, build_app, client, key, wait_entered
from tests.conftest import BUSINESS_SCHEMA, dsn_for

KEY = RecordKey("t", "POST /x", "k")
#: The privileges a deployment typically grants its application role.
APP_GRANTS = (
    "GRANT USAGE ON SCHEMA public TO {role};"
    "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role};"
    "GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}"
)

# (the database's owner makes these) -> a role that lacks one thing every request needs
LACKING = {
    "read-only-tables": (
        "REVOKE INSERT, UPDATE, DELETE ON idem_requests, idem_tokens, idem_waiters FROM {role}"
    ),
    "no-sequence": "REVOKE USAGE ON SEQUENCE idem_generation_seq FROM {role}",
    "no-claim-function": (
        "REVOKE EXECUTE ON FUNCTION idem_claim_key(text, text, text, bigint) FROM PUBLIC"
    ),
    "no-advisory-locks": (
        "REVOKE EXECUTE ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(bigint) FROM PUBLIC"
    ),
}


def as_role(dsn: str, role: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


Setup = Callable[..., Awaitable[tuple[str, str]]]


@pytest.fixture
async def role_database(pg_dsn: str) -> AsyncIterator[Setup]:
    """`await make(*statements, upto=N)`: a new database migrated to version N by its owner, the
    statements run there (`{role}` is a new login role), and (its DSN as that role, the role)."""
    made: list[tuple[str, str]] = []

    async def make(*statements: str, upto: int | None = None) -> tuple[str, str]:
        suffix = uuid.uuid4().hex[:10]
        name, role = f"idem_acl_{suffix}", f"idem_app_{suffix}"
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
            made.append((name, role))
            await admin.execute(f"CREATE ROLE {role} LOGIN")
        finally:
            await admin.close()
        owner_dsn = dsn_for(pg_dsn, name)
        conn = await asyncpg.connect(owner_dsn)
        try:
            if upto is None:
                await migrate(conn)
            else:
                async with conn.transaction():
                    for version, migration, text in sql.migrations():
                        if version <= upto:
                            await conn.execute(text)
                            await conn.execute(
                                "INSERT INTO idem_schema_migrations VALUES ($1, $2)",
                                version,
                                migration,
                            )
            await conn.execute(BUSINESS_SCHEMA)
            await conn.execute(
                f"GRANT ALL ON test_accounts, test_ledger, test_ledger_id_seq TO {role}"
            )
            for statement in statements:
                await conn.execute(statement.format(role=role))
        finally:
            await conn.close()
        return as_role(owner_dsn, role), role

    try:
        yield make
    finally:
        admin = await asyncpg.connect(pg_dsn)
        try:
            for name, role in made:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                await admin.execute(f"DROP ROLE IF EXISTS {role}")
        finally:
            await admin.close()


async def _owner_runs(dsn: str, statements: str) -> None:
    """Run `statements` as the database's owner (the test server's superuser)."""
    conn = await asyncpg.connect(as_role(dsn, "postgres"))
    try:
        await conn.execute(statements)
    finally:
        await conn.close()


@pytest.mark.parametrize("lacking", sorted(LACKING))
async def test_a_role_without_a_privilege_requests_need_is_refused_with_the_grants(
    role_database: Setup, lacking: str
) -> None:
    dsn, role = await role_database(APP_GRANTS, LACKING[lacking])
    with pytest.raises(ConfigurationError) as refused:
        await PostgresStore(dsn=dsn, listen=False).open()
    message = str(refused.value)
    assert f"the role {role} lacks privileges" in message
    # The message's own statements are the whole fix: run them, and requests go through.
    fix = message.split("objects' owner, ", 1)[1]
    assert fix.startswith("GRANT ")
    await _owner_runs(dsn, fix)
    async with PostgresStore(dsn=dsn, listen=False) as store, client(build_app(store)) as c:
        r = await c.post(
            "/accounts/a/credits", json={"amount": 1}, headers={"idempotency-key": "k"}
        )
    assert r.status_code == 201


async def test_a_role_without_usage_on_the_schema_is_not_told_to_migrate(
    role_database: Setup,
) -> None:
    """Its search_path resolves to no schema: it was told every migration was missing."""
    dsn, role = await role_database("REVOKE ALL ON SCHEMA public FROM PUBLIC")
    with pytest.raises(ConfigurationError) as refused:
        await PostgresStore(dsn=dsn, listen=False).open()
    assert f"GRANT USAGE ON SCHEMA public TO {role}" in str(refused.value)
    assert "lacks migration" not in str(refused.value)


async def test_a_role_that_cannot_read_the_migrations_table_gets_a_configuration_error(
    role_database: Setup,
) -> None:
    """asyncpg's InsufficientPrivilegeError came out of `open()` as it was; and `migrate` (its
    statements in one transaction, which the refusal aborted) said "current transaction is
    aborted" instead (found by probing)."""
    dsn, role = await role_database("GRANT USAGE ON SCHEMA public TO {role}")
    with pytest.raises(ConfigurationError) as refused:
        await PostgresStore(dsn=dsn, listen=False).open()
    assert f"GRANT SELECT ON public.idem_schema_migrations TO {role}" in str(refused.value)
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(ConfigurationError) as refused:
            await migrate(conn)
    finally:
        await conn.close()
    assert f"GRANT SELECT ON public.idem_schema_migrations TO {role}" in str(refused.value)


@pytest.mark.parametrize(
    ("dropped", "named"),
    [
        ("DROP TABLE idem_waiters", "idem_waiters"),
        (
            "DROP FUNCTION idem_claim_key(text, text, text, bigint) CASCADE",
            "idem_claim_key(text, text, text, bigint)",
        ),
    ],
)
async def test_a_recorded_migration_whose_objects_are_gone_is_named(
    role_database: Setup, dropped: str, named: str
) -> None:
    """Every request that reached the missing object was a 500; the store opened."""
    dsn, _ = await role_database(APP_GRANTS, dropped)
    with pytest.raises(ConfigurationError, match="recorded as applied") as refused:
        await PostgresStore(dsn=dsn, listen=False).open()
    assert named in str(refused.value)


async def test_the_command_line_reports_still_run_as_a_role_that_only_reads(
    role_database: Setup,
) -> None:
    from tests.integration.test_cli import cli

    dsn, _ = await role_database(
        "GRANT USAGE ON SCHEMA public TO {role};"
        "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}"
    )
    stats = cli("stats", dsn=dsn)
    assert stats.returncode == 0, stats.stderr


@pytest.mark.parametrize(
    ("grants", "refusal"),
    [
        ("GRANT USAGE ON SCHEMA public TO {role}", "permission denied for schema public"),
        ("GRANT USAGE, CREATE ON SCHEMA public TO {role}", "must be owner of function"),
    ],
    ids=["cannot-create", "not-the-owner"],
)
async def test_migrate_as_a_role_that_may_not_names_the_owner(
    role_database: Setup, grants: str, refusal: str
) -> None:
    """Migration 0007 replaces a function 0003 made: only its owner may."""
    from tests.integration.test_cli import cli

    dsn, _ = await role_database(grants, "GRANT SELECT ON idem_schema_migrations TO {role}", upto=6)
    run = cli("migrate", dsn=dsn)
    assert run.returncode == 1
    assert "migration 0007_claim_with_lock_value was refused" in run.stderr
    assert refusal in run.stderr
    assert "as the role that owns" in run.stderr
    assert "Traceback" not in run.stderr


async def test_migrate_over_objects_made_some_other_way_says_so(pg_dsn: str) -> None:
    """schema.sql applied by hand: the store asks for `migrate`, which met `already exists`."""
    name = f"idem_acl_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        conn = await asyncpg.connect(dsn_for(pg_dsn, name))
        try:
            await conn.execute(sql.schema_sql())
            with pytest.raises(ConfigurationError) as refused:
                await migrate(conn)
            assert await conn.fetchval("SELECT count(*) FROM idem_schema_migrations") == 0
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        await admin.close()
    assert "0001_initial is not recorded" in str(refused.value)
    assert "already exists" in str(refused.value)
    # (The way that keeps the records first; dropping them, which loses every outcome, last.)
    message = str(refused.value)
    assert message.index("record the versions") < message.index("Drop the idem_ tables")
    assert "only if they hold no record you need" in message
    # The INSERT it suggests names the first migration as migrate records it (not its file's).
    [(version, recorded, _), *_] = sql.migrations()
    assert f"VALUES ({version}, '{recorded}')" in message


STATUS = "/idempotency/status"
CREDIT = "/accounts/a/credits"
CREDIT_OP = "POST /accounts/{account_id}/credits"
NO_LOCKS = "REVOKE SELECT ON pg_catalog.pg_locks FROM PUBLIC"


def _lock_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "pg_catalog.pg_locks" in r.getMessage()]


async def test_a_role_that_may_not_read_pg_locks_has_statuses_from_records_alone(
    role_database: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: with SELECT on pg_locks revoked from PUBLIC (hardened servers do), the
    status resource's one statement was refused, so every status, even of a finished request,
    was a 500. The store warns when it opens, and reads the record alone: a finished request is
    found, and a key with no record is a 404 that says a running request may not show."""
    dsn, role = await role_database(APP_GRANTS, NO_LOCKS)
    with caplog.at_level(logging.WARNING, logger="idem_middleware.store"):
        async with PostgresStore(dsn=dsn, listen=False) as store:
            assert len(_lock_warnings(caplog)) == 1  # at the open, before any request
            app = build_app(store)
            async with client(app) as c:
                await c.post(CREDIT, json={"amount": 1}, headers=key("done"))
                done = await c.get(STATUS, params={"operation": CREDIT_OP, "key": "done"})
            async with client(app) as c, Held(app.state.probe) as held:
                first = held.start(c.post(CREDIT, json={"amount": 1}, headers=key("running")))
                await wait_entered(app.state.probe)
                running = await c.get(STATUS, params={"operation": CREDIT_OP, "key": "running"})
                held.release()
                assert (await asyncio.wait_for(first, BOUND)).status_code == 201
    assert done.status_code == 200, done.text
    assert done.json()["state"] == "succeeded"
    detail = assert_problem(running, 404, "record-not-found")["detail"]
    assert "may not show" in detail
    assert "same key" in detail
    [warning] = _lock_warnings(caplog)
    assert f"GRANT SELECT ON pg_catalog.pg_locks TO {role}" in warning


async def test_pg_locks_revoked_after_the_store_opened_is_said_once_and_read_around(
    role_database: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    dsn, _ = await role_database(APP_GRANTS)
    with caplog.at_level(logging.WARNING, logger="idem_middleware.store"):
        async with PostgresStore(dsn=dsn, listen=False) as store, client(build_app(store)) as c:
            await c.post(CREDIT, json={"amount": 1}, headers=key("k"))
            query = {"operation": CREDIT_OP, "key": "k"}
            before = await c.get(STATUS, params=query)  # (its statement prepared, and cached)
            await _owner_runs(dsn, NO_LOCKS)
            after = [await c.get(STATUS, params=query) for _ in range(3)]
            absent = await c.get(STATUS, params={"operation": CREDIT_OP, "key": "absent"})
    assert [r.status_code for r in (before, *after)] == [200] * 4, after[0].text
    assert "may not show" in assert_problem(absent, 404, "record-not-found")["detail"]
    assert len(_lock_warnings(caplog)) == 1
