"""An application role with a schema of its own name, which the default search_path (`"$user",
public`) puts first, on a database whose idempotency schema its owner migrated into public.

The store's statements find public's tables through the path, but the store looked for its
migrations in the role's own schema alone: it refused to open ("lacks migrations: run migrate"),
and `migrate` run as told made a second, empty set of idem_ tables there that hid public's, so a
key already recorded ran again. Both now refuse, naming both schemas and the search_path fix.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.store.migrations import migrate, pending_versions
from tests.apps import assert_replay_of, build_app, client, key
from tests.conftest import BUSINESS_SCHEMA, dsn_for
from tests.integration.test_cli import cli
from tests.integration.test_store_access import APP_GRANTS, as_role

#: `await make()`: (the owner's DSN, the application role's DSN, the role).
Setup = Callable[[], Awaitable[tuple[str, str, str]]]


@pytest.fixture
async def own_schema_role(pg_dsn: str) -> AsyncIterator[Setup]:
    """A new database migrated into public by its owner, and a login role granted what an
    application needs there, owning a schema of its own name."""
    made: list[tuple[str, str]] = []

    async def make() -> tuple[str, str, str]:
        suffix = uuid.uuid4().hex[:10]
        name, role = f"idem_path_{suffix}", f"idem_app_{suffix}"
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
            await migrate(conn)
            await conn.execute(BUSINESS_SCHEMA)
            await conn.execute(APP_GRANTS.format(role=role))
            await conn.execute(f"CREATE SCHEMA {role} AUTHORIZATION {role}")
        finally:
            await conn.close()
        return owner_dsn, as_role(owner_dsn, role), role

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


async def test_a_schema_of_the_roles_own_first_on_its_path_is_refused_not_shadowed(
    own_schema_role: Setup,
) -> None:
    owner_dsn, dsn, role = await own_schema_role()
    async with PostgresStore(dsn=owner_dsn, listen=False) as store, client(build_app(store)) as c:
        first = await c.post("/accounts/a/credits", json={"amount": 1}, headers=key("k"))
    assert first.status_code == 201

    with pytest.raises(ConfigurationError) as refused:
        await PostgresStore(dsn=dsn, listen=False).open()
    message = str(refused.value)
    assert f"the role {role} creates in and looks first in {role}" in message
    assert "the idempotency schema is in public" in message
    fix = f"ALTER ROLE {role} SET search_path = public"
    assert f"({fix}," in message
    assert "migrate" not in message  # (running it was the harm)

    conn = await asyncpg.connect(dsn)
    try:
        for reading in (pending_versions, migrate):  # `migrate --check`, and `migrate`
            with pytest.raises(ConfigurationError) as again:
                await reading(conn)
            assert str(again.value) == message
        made = await conn.fetchval(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = $1",
            role,
        )
        assert made == 0  # no second set of tables in the role's schema
    finally:
        await conn.close()
    checked = cli("migrate", "--check", dsn=dsn)
    assert checked.returncode == 2  # (the check failed: 1 is "pending")
    assert fix in checked.stderr

    owner = await asyncpg.connect(owner_dsn)
    try:
        await owner.execute(fix)  # the fix the message names is the whole fix
    finally:
        await owner.close()
    async with PostgresStore(dsn=dsn, listen=False) as store, client(build_app(store)) as c:
        retry = await c.post("/accounts/a/credits", json={"amount": 1}, headers=key("k"))
    assert_replay_of(retry, first)
