"""Applying the numbered migrations. Run by `idem-middleware migrate`, never at request time."""

from __future__ import annotations

import numbers
from typing import Any

import asyncpg

from .. import sql
from ..errors import ConfigurationError, StoreError

#: What a migration meets when its objects exist though it is not recorded.
_ALREADY_THERE = (
    asyncpg.DuplicateTableError,
    asyncpg.DuplicateObjectError,
    asyncpg.DuplicateFunctionError,
    asyncpg.DuplicateColumnError,
)

# Concurrent migrators (several app hosts starting at once) queue on this transaction lock.
_LOCK_ID = 0x1DE4_0001

#: How long a migration waits for a lock on a table it alters (`lock_timeout`).
LOCK_TIMEOUT_SECONDS = 5.0
#: The longest `lock_timeout` the server takes (2**31 - 1 ms, about 24.8 days).
MAX_LOCK_TIMEOUT_SECONDS = (2**31 - 1) / 1000


async def applied_versions(conn: asyncpg.Connection[Any]) -> set[int]:
    # Read pg_class with this statement's snapshot, not to_regclass(): to_regclass takes no lock, so
    # a backend that looked the name up before (and cached "absent") does not see the table a
    # concurrent migrator committed while this one waited on the lock, and creates it again.
    # The schema is matched by name, not cast with ::regnamespace, which parses its text as an
    # identifier: a schema that needs quoting ("Idem", "my schema") was not found.
    # `elsewhere`: the first schema on the path that has the migrations table (see _shadowing).
    found: Any = await conn.fetchrow(
        "SELECT quote_ident(current_schema()) AS schema, quote_ident(current_user) AS role,"
        " current_setting('search_path') AS search_path,"
        " EXISTS (SELECT FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
        " ON n.oid = c.relnamespace"
        " WHERE c.relname = 'idem_schema_migrations' AND n.nspname = current_schema()) AS found,"
        " (SELECT quote_ident(s.name)"
        " FROM unnest(current_schemas(false)) WITH ORDINALITY AS s(name, at)"
        " JOIN pg_catalog.pg_namespace n ON n.nspname = s.name JOIN pg_catalog.pg_class c"
        " ON c.relnamespace = n.oid AND c.relname = 'idem_schema_migrations'"
        " ORDER BY s.at LIMIT 1) AS elsewhere"
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
        if found["elsewhere"] is not None:
            raise _shadowing(found)
        return set()
    try:
        rows = await conn.fetch("SELECT version FROM idem_schema_migrations")
    except asyncpg.InsufficientPrivilegeError as exc:
        # (Not asked again: under `migrate` the error aborted the transaction it ran in.)
        schema = found["schema"]
        raise ConfigurationError(
            f"the role {found['role']} cannot read {schema}.idem_schema_migrations ({exc}): "
            f"grant it the idempotency schema's privileges, as the schema's owner (GRANT "
            f"SELECT ON {schema}.idem_schema_migrations TO {found['role']}; the store "
            "names the rest when it opens)"
        ) from exc
    if damaged := [r["version"] for r in rows if type(r["version"]) is not int]:
        # (A version column retyped by hand: no version matched, so every migration looked
        # pending, and `migrate` then said the schema was "made some other way".)
        raise ConfigurationError(
            f"idem_schema_migrations is damaged: its versions must be whole numbers, not "
            f"{damaged[0]!r:.40}; restore it (ALTER TABLE idem_schema_migrations ALTER "
            "version TYPE integer USING version::integer, if what it holds are numbers)"
        )
    return {r["version"] for r in rows}


def _shadowing(found: Any) -> ConfigurationError:
    """The role's own schema (`"$user"`, first on the default search_path) has no idempotency
    schema, and a schema later on its path has one. The store's statements find that one's
    tables, but a migrate made a second, empty set in the first schema, which then hid them: a
    key already recorded ran again. Refused, by the store and by migrate alike."""
    schema, elsewhere = found["schema"], found["elsewhere"]
    return ConfigurationError(
        f"the idempotency schema is in {elsewhere}, but the role {found['role']} creates in "
        f"and looks first in {schema} (its search_path: {found['search_path']}), which has "
        f"none: migrating would make a second, empty one in {schema} that hides {elsewhere}'s "
        f"records. Put {elsewhere} first on the role's search_path (ALTER ROLE {found['role']} "
        f"SET search_path = {elsewhere}, adding after it any other schema the application "
        "uses), or give the store that search_path (connect_kwargs={'server_settings': "
        "{'search_path': ...}}), and connect again"
    )


async def migrate(
    conn: asyncpg.Connection[Any], *, lock_timeout: float | None = LOCK_TIMEOUT_SECONDS
) -> list[int]:
    """Apply the migrations this database lacks, in one transaction; return those applied.

    A migration that alters a table waits for the transactions using it (a transactional
    handler holds one for its whole run) and, while it waits, every request that reads the
    table queues behind it. It waits at most `lock_timeout` seconds (None: for ever): then
    nothing is applied, the queued requests go on, and StoreError names the sessions that held
    the table."""
    real = isinstance(lock_timeout, numbers.Real) and not isinstance(lock_timeout, bool)
    if lock_timeout is not None and not (real and 0 < lock_timeout <= MAX_LOCK_TIMEOUT_SECONDS):
        # (Refused before anything is done: the server refuses more, after the lock was waited
        # for; `lock_timeout = 0` would wait for ever; True was one second.)
        raise ValueError(
            f"lock_timeout must be more than 0 and at most {MAX_LOCK_TIMEOUT_SECONDS:g} s "
            f"(None: no bound), not {lock_timeout!r}"
        )
    applied: list[int] = []
    failed = ""
    try:
        # READ COMMITTED whatever the sessions' default_transaction_isolation: each statement
        # then reads what committed before it began. Under REPEATABLE READ the snapshot was the
        # advisory lock's statement's, taken before its wait, so a second migrator did not see
        # what the first had just committed, applied it all again, and was told the schema was
        # "made some other way" (drop the tables).
        async with conn.transaction(isolation="read_committed"):
            # No timeout of the role's or the database's cuts short the wait for another
            # migrator (it waits as long as that one takes), nor the migrations themselves.
            # Local to this transaction. (transaction_timeout: PostgreSQL 17 and later.)
            await conn.execute(
                "SELECT set_config(name, '0', true) FROM pg_catalog.pg_settings"
                " WHERE name IN ('lock_timeout', 'statement_timeout', 'transaction_timeout')"
            )
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_ID)
            # Then the migrations' own bound on their waits for a table's lock (0: none).
            await conn.execute(
                "SELECT set_config('lock_timeout', $1, true)",
                "0" if lock_timeout is None else f"{max(1, round(lock_timeout * 1000))}ms",
            )
            done = await applied_versions(conn)
            for version, name, text in sql.migrations():
                if version in done:
                    continue
                failed = f"{version:04d}_{name}"
                await _apply(conn, failed, text)
                await conn.execute(
                    "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)",
                    version,
                    name,
                )
                applied.append(version)
    except asyncpg.LockNotAvailableError as exc:
        # (`failed` is empty when the wait was to read idem_schema_migrations, before any.)
        what = f"migration {failed}" if failed else "migrate"
        waited = "" if lock_timeout is None else f" more than {lock_timeout:g} s"
        raise StoreError(
            f"{what} waited{waited} for a lock ({exc}) and nothing was applied: "
            f"{await _holders(conn)}. Run `idem-middleware migrate` again when they are over "
            "(requests went on meanwhile), or give it longer (--lock-timeout)"
        ) from exc
    return applied


async def _apply(conn: asyncpg.Connection[Any], migration: str, text: str) -> None:
    try:
        await conn.execute(text)
    except asyncpg.InsufficientPrivilegeError as exc:
        # Creating in the schema, or altering or dropping what an earlier migration
        # made, which only the objects' owner may do.
        raise ConfigurationError(
            f"migration {migration} was refused: {exc}; run `idem-middleware "
            "migrate` as the role that owns the idempotency schema's objects (the one "
            "that ran the earlier migrations; on a new schema, one that may create in it): "
            "only their owner may alter or index them"
        ) from exc
    except _ALREADY_THERE as exc:
        raise ConfigurationError(
            f"migration {migration} is not recorded in idem_schema_migrations, "
            f"but what it creates is there already ({exc}): the schema was made some "
            "other way (schema.sql applied by hand, a copy of the tables?). Keep its "
            "records: if the schema is complete up to a version (schema.sql is the "
            "latest), record the versions it holds in idem_schema_migrations (INSERT INTO "
            "idem_schema_migrations (version, name) VALUES (1, 'initial'), ...) and "
            "run migrate again. Drop the idem_ tables, sequence and functions only if they "
            "hold no record you need: every key they hold would run its effect again"
        ) from exc


async def _holders(conn: asyncpg.Connection[Any]) -> str:
    """The oldest transactions open in this database (those the migration waited for are
    among them), as far as this role may see them."""
    rows = await conn.fetch(
        "SELECT pid, application_name, state,"
        " round(extract(epoch FROM clock_timestamp() - xact_start)) AS age"
        " FROM pg_catalog.pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND xact_start IS NOT NULL ORDER BY xact_start LIMIT 5"
    )
    if not rows:
        return (
            "no open transaction this role may see (pg_stat_activity shows other roles' "
            "sessions to members of pg_read_all_stats)"
        )
    return "transactions open in this database: " + "; ".join(
        f"pid {r['pid']} ({r['application_name'] or 'no application_name'}, "
        f"{r['state']}, for {r['age']} s)"
        for r in rows
    )


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
