"""Applying the numbered migrations. Run by `idem-middleware migrate`, never at request time."""

from __future__ import annotations

from typing import Any

import asyncpg

from .. import sql
from ..errors import ConfigurationError

# Concurrent migrators (several app hosts starting at once) queue on this transaction lock.
_LOCK_ID = 0x1DE4_0001


async def applied_versions(conn: asyncpg.Connection[Any]) -> set[int]:
    # Read pg_class with this statement's snapshot, not to_regclass(): to_regclass takes no lock, so
    # a backend that looked the name up before (and cached "absent") does not see the table a
    # concurrent migrator committed while this one waited on the lock, and creates it again.
    # The schema is matched by name, not cast with ::regnamespace, which parses its text as an
    # identifier: a schema that needs quoting ("Idem", "my schema") was not found.
    exists = await conn.fetchval(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
        " ON n.oid = c.relnamespace"
        " WHERE c.relname = 'idem_schema_migrations' AND n.nspname = current_schema())"
    )
    if not exists:
        return set()
    return {r["version"] for r in await conn.fetch("SELECT version FROM idem_schema_migrations")}


async def migrate(conn: asyncpg.Connection[Any]) -> list[int]:
    """Apply the migrations this database lacks, in one transaction; return those applied."""
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_ID)
        done = await applied_versions(conn)
        for version, name, text in sql.migrations():
            if version in done:
                continue
            await conn.execute(text)
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
