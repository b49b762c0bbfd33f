"""A purge the database refuses because it takes no writes (a standby the DSN reaches after a
failover, or a database or role whose sessions are read-only) tells the operator to run it where
the database takes writes: it said "run it again", which fails the same way there."""

from __future__ import annotations

from urllib.parse import urlsplit

import asyncpg

from idem_middleware.cli_connect import run_again
from tests.conftest import _fresh_database
from tests.integration.test_cli import cli


async def test_a_purge_on_a_read_only_database_says_where_to_run_it(admin_dsn: str) -> None:
    dsn = await _fresh_database(admin_dsn, "idem_cli_read_only")
    assert cli("migrate", dsn=dsn).returncode == 0
    name = urlsplit(dsn).path.lstrip("/")
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        refused = cli("purge", dsn=dsn)
        await admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off')
    finally:
        await admin.close()
    assert refused.returncode == 1, refused.stderr
    assert "run it again where the database takes writes" in refused.stderr, refused.stderr
    assert "read-only transaction" in refused.stderr
    writable = cli("purge", dsn=dsn)  # (the same command where the database takes writes)
    assert writable.returncode == 0, writable.stderr


def test_the_drivers_read_only_refusal_itself_gets_the_same_advice() -> None:
    """As asyncpg raises it (not wrapped in the store's error, as a command's own statement's
    is): where the database takes writes, not "run it again"."""
    refused = asyncpg.ReadOnlySQLTransactionError(
        "cannot execute DELETE in a read-only transaction"
    )
    assert run_again(refused).startswith("run it again where the database takes writes")
