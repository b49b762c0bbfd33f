"""Applying the numbered migrations. Run by `idem-middleware migrate`, never at request time."""

from __future__ import annotations

from typing import Any

import asyncpg

from .. import sql
from ..errors import ConfigurationError

#: What a migration meets when its objects exist though it is not recorded.
_ALREADY_THERE = (
    asyncpg.DuplicateTableError,
    asyncpg.DuplicateObjectError,
    asyncpg.DuplicateFunctionError,
    asyncpg.DuplicateColumnError,
)

# Concurrent migrators (several app hosts starting at once) queue on this transaction lock.
_LOCK_ID = 0x1DE4_0001


async def applied_versions(conn: asyncpg.Connection[Any]) -> set[int]:
    # Read pg_class with this statement's snapshot, not to_regclass(): to_regclass takes no lock, so
    # a backend that looked the name up before (and cached "absent") does not see the table a
    # concurrent migrator committed while this one waited on the lock, and creates it again.
    # The schema is matched by name, not cast with ::regnamespace, which parses its text as an
    # identifier: a schema that needs quoting ("Idem", "my schema") was not found.
    found: Any = await conn.fetchrow(
        "SELECT current_schema() AS schema, quote_ident(current_user) AS role,"
        " current_setting('search_path') AS search_path,"
        " EXISTS (SELECT FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
        " ON n.oid = c.relnamespace"
        " WHERE c.relname = 'idem_schema_migrations' AND n.nspname = current_schema()) AS found"
    )
    if found["schema"] is None:
        # No schema on the path exists or is usable by this role: a role without USAGE on the
        # store's schema was told its (migrated) database lacked every migration.
        raise ConfigurationError(
            f"no schema on the search_path ({found['search_path']}) exists or is usable by the "
            f"role {found['role']}: grant it USAGE on the idempotency schema, as the schema's "
            f"owner (GRANT USAGE ON SCHEMA public TO {found['role']}, or the schema it was "
            "migrated into), or set its search_path"
        )
    if not found["found"]:
        return set()
    try:
        rows = await conn.fetch("SELECT version FROM idem_schema_migrations")
    except asyncpg.InsufficientPrivilegeError as exc:
        schema = await conn.fetchval("SELECT quote_ident(current_schema())")
        raise ConfigurationError(
            f"the role {found['role']} cannot read {schema}.idem_schema_migrations ({exc}): "
            f"grant it the idempotency schema's privileges, as the schema's owner (GRANT "
            f"SELECT ON {schema}.idem_schema_migrations TO {found['role']}; the store "
            "names the rest when it opens)"
        ) from exc
    return {r["version"] for r in rows}


async def migrate(conn: asyncpg.Connection[Any]) -> list[int]:
    """Apply the migrations this database lacks, in one transaction; return those applied."""
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_ID)
        done = await applied_versions(conn)
        for version, name, text in sql.migrations():
            if version in done:
                continue
            try:
                await conn.execute(text)
            except asyncpg.InsufficientPrivilegeError as exc:
                # Creating in the schema, or altering or dropping what an earlier migration
                # made, which only the objects' owner may do.
                raise ConfigurationError(
                    f"migration {version:04d}_{name} was refused: {exc}; run `idem-middleware "
                    "migrate` as the role that owns the idempotency schema's objects (the one "
                    "that ran the earlier migrations) or one that may create in its schema"
                ) from exc
            except _ALREADY_THERE as exc:
                raise ConfigurationError(
                    f"migration {version:04d}_{name} is not recorded in idem_schema_migrations, "
                    f"but what it creates is there already ({exc}): the schema was made some "
                    "other way (schema.sql applied by hand, a copy of the tables?). Drop the "
                    "idem_ tables, sequence and functions and run migrate again, or, if the "
                    "schema is complete up to a version, record those versions in "
                    "idem_schema_migrations"
                ) from exc
            await conn.execute(
                "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)", version, name
            )
            applied.append(version)
    return applied


async def pending_versions(conn: asyncpg.Connection[Any]) -> list[int]:
    done = await applied_versions(conn)
    return [v for v, _, _ in sql.migrations() if v not in done]


async def require_migrated(conn: asyncpg.Connection[Any]) -> None:
    """ConfigurationError unless every migration this version knows is applied (a database
    migrated by a newer version passes: its extra migrations are that version's business)."""
    done = await applied_versions(conn)
    missing = [f"{v:04d}_{name}" for v, name, _ in sql.migrations() if v not in done]
    if missing:
        raise ConfigurationError(
            f"the idempotency schema lacks migration(s) {', '.join(missing)}: run "
            "`idem-middleware --dsn postgresql://... migrate` (or set IDEM_DATABASE_URL or "
            "DATABASE_URL) against this database before starting the application"
        )
