"""`idem-middleware migrate --check` tells a deploy script "up to date" (0), "pending" (1) and
"the check failed" (2) apart: it exited 1 for a server it could not reach, a role that may not
read the migrations table, or a damaged one, as for migrations pending."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

import asyncpg

from tests.conftest import _fresh_database, migrated_database
from tests.integration.test_cli import cli
from tests.integration.test_store_access import Setup
from tests.integration.test_store_access import role_database as role_database


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_pending_and_up_to_date_keep_1_and_0(admin_dsn: str) -> None:
    dsn = await _fresh_database(admin_dsn, "idem_opsleft_check_fresh")
    pending = cli("migrate", "--check", "--json", dsn=dsn)
    assert pending.returncode == 1, pending.stderr
    assert json.loads(pending.stdout)["pending"]
    assert cli("migrate", dsn=dsn).returncode == 0
    done = cli("migrate", "--check", dsn=dsn)
    assert (done.returncode, done.stdout.strip()) == (0, "schema is up to date")


def test_a_server_it_cannot_reach_exits_2() -> None:
    dsn = f"postgresql://nobody@127.0.0.1:{_closed_port()}/idem"
    for json_args in ((), ("--json",)):
        failed = cli("migrate", "--check", *json_args, dsn=dsn)
        assert failed.returncode == 2, (failed.stdout, failed.stderr)
        assert "cannot connect to" in failed.stderr
        assert "Traceback" not in failed.stderr
    assert json.loads(failed.stdout)["pending"] is None
    assert "cannot connect" in json.loads(failed.stdout)["error"]


async def test_a_role_that_cannot_read_the_migrations_table_exits_2(
    role_database: Setup,
) -> None:
    dsn, role = await role_database("GRANT USAGE ON SCHEMA public TO {role}")
    failed = cli("migrate", "--check", dsn=dsn)
    assert failed.returncode == 2, (failed.stdout, failed.stderr)
    assert f"GRANT SELECT ON public.idem_schema_migrations TO {role}" in failed.stderr


async def test_a_damaged_migrations_table_exits_2(admin_dsn: str) -> None:
    dsn = await migrated_database(admin_dsn, "idem_opsleft_check_damaged")
    conn: Any = await asyncpg.connect(dsn)
    try:
        await conn.execute("ALTER TABLE idem_schema_migrations RENAME version TO v")
        failed = cli("migrate", "--check", dsn=dsn)
        assert failed.returncode == 2, (failed.stdout, failed.stderr)
        assert '"version" does not exist' in failed.stderr
        assert "Traceback" not in failed.stderr  # (the server's refusal is no bug)
        # Versions that are no numbers: "all pending" (exit 1), and `migrate` then said the
        # schema was "made some other way". Damaged, said so.
        await conn.execute(
            "ALTER TABLE idem_schema_migrations RENAME v TO version;"
            "ALTER TABLE idem_schema_migrations ALTER version TYPE text"
        )
        failed = cli("migrate", "--check", dsn=dsn)
        assert failed.returncode == 2, (failed.stdout, failed.stderr)
        assert "idem_schema_migrations is damaged" in failed.stderr
        assert "Traceback" not in failed.stderr
    finally:
        await conn.close()


def test_stdout_closed_exits_2(db_dsn: str) -> None:
    closed = subprocess.run(
        f'"{sys.executable}" -m idem_middleware.cli --dsn "$DSN" migrate --check >&-',
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        env={"DSN": db_dsn, "PATH": "/usr/bin:/bin"},
    )
    assert closed.returncode == 2, closed.stderr
    assert "standard output is closed" in closed.stderr


def test_the_help_says_which_status_is_which() -> None:
    shown = " ".join(cli("migrate", "--help").stdout.split())
    assert "exit 0 if the schema is up to date, 1 if migrations are pending, 2 if" in shown
