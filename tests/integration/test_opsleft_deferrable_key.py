"""A DEFERRABLE key on idem_requests (tenant, operation, idem_key), made by hand, is refused when
the store opens, naming the fix: the claims' ON CONFLICT cannot use it (EXPLAIN accepts it), so
the store opened and then answered every lease-mode claim, and every transactional claim but the
fast path's, with a 500."""

from __future__ import annotations

import re
from typing import Any

import asyncpg
import pytest

from idem_middleware.errors import ConfigurationError
from idem_middleware.store.postgres import PostgresStore
from tests.apps.clients import client, counting_pay_app
from tests.conftest import migrated_database

_KEY = "(tenant, operation, idem_key)"


async def _altered(admin_dsn: str, name: str, *statements: str) -> str:
    dsn = await migrated_database(admin_dsn, name)
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()
    return dsn


async def _serves(dsn: str) -> None:
    """Both modes claim, run once and replay on this database."""
    for mode in ("lease", "transactional"):
        async with PostgresStore(dsn=dsn, fast_path=False) as store:
            app, runs = counting_pay_app(store, mode)
            async with client(app) as c:
                for _ in range(2):
                    answer = await c.post("/pay", json={}, headers={"idempotency-key": mode})
                    assert answer.status_code == 201, answer.text
            assert len(runs) == 1


@pytest.mark.parametrize("initially", ["IMMEDIATE", "DEFERRED"])
async def test_a_deferrable_primary_key_is_refused_at_open_with_its_fix(
    admin_dsn: str, initially: str
) -> None:
    dsn = await _altered(
        admin_dsn,
        f"idem_opsleft_deferrable_{initially.lower()}",
        "ALTER TABLE idem_requests DROP CONSTRAINT idem_requests_pkey, ADD CONSTRAINT "
        f"idem_requests_pkey PRIMARY KEY {_KEY} DEFERRABLE INITIALLY {initially}",
    )
    with pytest.raises(ConfigurationError) as refused:
        async with PostgresStore(dsn=dsn):
            pass
    message = str(refused.value)
    assert "DEFERRABLE (idem_requests_pkey)" in message
    fix = re.search(r"as the table's owner: (.*)$", message)
    assert fix is not None, message
    assert fix.group(1) == (
        "ALTER TABLE idem_requests DROP CONSTRAINT idem_requests_pkey, ADD CONSTRAINT "
        "idem_requests_pkey PRIMARY KEY (tenant, operation, idem_key)"
    )
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(fix.group(1))  # the fix named works
    finally:
        await conn.close()
    await _serves(dsn)


async def test_a_deferrable_unique_key_beside_the_primary_key_is_refused(admin_dsn: str) -> None:
    # Both are arbiters of ON CONFLICT (tenant, operation, idem_key): claims failed alike.
    dsn = await _altered(
        admin_dsn,
        "idem_opsleft_deferrable_unique",
        f'ALTER TABLE idem_requests ADD CONSTRAINT "Idem Key" UNIQUE {_KEY} '
        "INCLUDE (state) DEFERRABLE",
    )
    with pytest.raises(ConfigurationError) as refused:
        async with PostgresStore(dsn=dsn):
            pass
    assert (
        'DROP CONSTRAINT "Idem Key", ADD CONSTRAINT "Idem Key" UNIQUE (tenant, operation, '
        "idem_key) INCLUDE (state)" in str(refused.value)
    )


async def test_a_deferrable_constraint_on_other_columns_is_no_arbiter(admin_dsn: str) -> None:
    # Not what the claims name: they work, and the store opens.
    dsn = await _altered(
        admin_dsn,
        "idem_opsleft_deferrable_other",
        "ALTER TABLE idem_requests ADD CONSTRAINT other_key UNIQUE "
        "(tenant, operation, idem_key, generation) DEFERRABLE INITIALLY DEFERRED",
    )
    await _serves(dsn)


async def test_the_request_time_failure_it_prevents(admin_dsn: str) -> None:
    """What the check stands for: with the key deferrable, the ordinary claim is refused by
    the server (if PostgreSQL ever accepts it, the check may go)."""
    dsn = await _altered(
        admin_dsn,
        "idem_opsleft_deferrable_claim",
        "ALTER TABLE idem_requests DROP CONSTRAINT idem_requests_pkey, ADD CONSTRAINT "
        f"idem_requests_pkey PRIMARY KEY {_KEY} DEFERRABLE",
    )
    conn: Any = await asyncpg.connect(dsn)
    try:
        with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError, match="deferrable"):
            await conn.execute(
                "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, "
                "mode, retention, generation) VALUES ('t', 'o', 'k', '\\x00', 'pending', "
                f"'lease', interval '1 day', 1) ON CONFLICT {_KEY} DO NOTHING"
            )
    finally:
        await conn.close()
