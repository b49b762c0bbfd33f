"""The pytest plugin's databases (idem_middleware.pytest_plugin): the name of a run's database
and its reservation on a server given by `IDEM_TEST_DSN`, creating, migrating, emptying and
dropping it, each from synchronous fixtures in an event loop of its own."""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Coroutine
from typing import Any, NoReturn
from urllib.parse import unquote, urlsplit, urlunsplit

import pytest

#: The environment variable naming an existing server to test against.
DSN_ENV = "IDEM_TEST_DSN"
_DATABASE = "idem_pytest"
TABLES = "idem_requests, idem_tokens, idem_outbox, idem_inbox, idem_waiters"
#: How long the reservation's connection may take to open or close.
_WAIT = 10.0


def database_name() -> str:
    """The test database's name: one per pytest-xdist worker, which run at the same time (one
    database for all, each worker dropped and truncated the others' while they ran)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return f"{_DATABASE}_{worker}" if re.fullmatch(r"[A-Za-z0-9_]{1,30}", worker) else _DATABASE


def run_sync(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion from sync code, even if a loop runs in this thread."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coroutine))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="idem-pytest-setup")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


#: How many runs at once may each have a database of their own on one server.
_RUNS = 100
#: The first key of the advisory locks a run holds on its database's name.
_LOCK_CLASS = 0x1DE4


def _refuse_own(name: str) -> None:
    pytest.fail(
        f"idem_postgres_dsn: {DSN_ENV} names the database {name}, which the plugin creates and "
        f"drops for its tests ({_DATABASE}, {_DATABASE}_1, {_DATABASE}_gw0 ...): point it at "
        "another database, e.g. postgres",
        pytrace=False,
    )


def _unreachable(server_dsn: str, exc: BaseException) -> NoReturn:
    from .cli_connect import shown_dsn  # (the DSN without its password)

    cause = f"no answer in {_WAIT:g} s" if isinstance(exc, TimeoutError) else str(exc)
    pytest.fail(
        f"idem_postgres_dsn: cannot connect to the server {DSN_ENV} names "
        f"({shown_dsn(server_dsn)}): {cause or type(exc).__name__}; start it or correct "
        f"{DSN_ENV}, or unset {DSN_ENV} for a throwaway embedded PostgreSQL",
        pytrace=False,
    )


class Reservation:
    """The name of this run's database on a server given by `IDEM_TEST_DSN`, held for the run
    by an advisory lock on a connection of its own (in an event loop of its own thread, as the
    test's loops come and go). Two runs at once on one server (two terminals, two CI jobs)
    shared the database: the second dropped it under the first (`WITH (FORCE)`), whose tests
    then failed with "database does not exist". Now the second takes the next name
    (`idem_pytest_1` ...). A run that was killed holds nothing: the next one drops its database
    and reuses the name."""

    def __init__(self, server_dsn: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="idem-pytest-database", daemon=True
        )
        self._thread.start()
        self._conn: Any = None
        try:
            self.database = self._call(self._reserve(server_dsn))
        except BaseException:
            self.release()
            raise

    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(_WAIT * 6)

    async def _reserve(self, server_dsn: str) -> str:
        import asyncpg  # (here, not at the top: the plugin loads in every pytest run)

        failure: Exception | None = None
        try:  # (bounded: a server that accepts and never answers hung the run 60 s, then a bare
            # TimeoutError, naming neither the server nor IDEM_TEST_DSN)
            self._conn = await asyncpg.connect(server_dsn, timeout=_WAIT)
        except asyncpg.InvalidCatalogNameError as exc:
            # (One of the plugin's names, absent: said as when it exists, not as asyncpg's
            # "does not exist", which sends one to create it.)
            # (Named in the DSN's path, or in the server's message when the DSN gives it
            # otherwise: `dbname=...`, PGDATABASE.)
            path = urlsplit(server_dsn).path.lstrip("/") if "://" in server_dsn else ""
            named = re.search(rf'"({_DATABASE}(?:_[A-Za-z0-9_]*)?)"', str(exc))
            for name in (unquote(path), named[1] if named else ""):
                if name == _DATABASE or name.startswith(f"{_DATABASE}_"):
                    _refuse_own(name)
            failure = exc
        except Exception as exc:
            failure = exc
        if failure is not None:  # (out of the except: the report shows no chained traceback)
            _unreachable(server_dsn, failure)
        given = await self._conn.fetchval("SELECT current_database()")
        if given == _DATABASE or given.startswith(f"{_DATABASE}_"):
            # It was dropped (WITH (FORCE)) as the run's own, or failed to be (ObjectInUseError)
            # while this very connection held it: never the database of IDEM_TEST_DSN.
            _refuse_own(given)
        base = database_name()
        for n in range(_RUNS):
            name = base if n == 0 else f"{base}_{n}"
            if await self._conn.fetchval(
                "SELECT pg_try_advisory_lock($1, hashtext($2))", _LOCK_CLASS, name
            ):
                return name
        raise RuntimeError(f"{_RUNS} test runs hold a database on this server already")

    def release(self) -> None:
        """Close the connection (which releases the lock) and stop the thread."""
        try:
            if self._conn is not None:
                conn, self._conn = self._conn, None
                self._call(asyncio.wait_for(conn.close(), _WAIT))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_WAIT)
            if not self._thread.is_alive():
                self._loop.close()


#: An embedded server's settings: its data is deleted at the run's end, so nothing is worth
#: flushing to disk. A commit still reaches the kernel before it is acknowledged: a server killed
#: or stopped at once loses nothing; only the machine's crash would. (Commits about 3x quicker.)
THROWAWAY_SETTINGS = {"fsync": "off", "full_page_writes": "off"}


async def tuned_throwaway(server_dsn: str) -> None:
    """Apply THROWAWAY_SETTINGS to a throwaway server (never to one `IDEM_TEST_DSN` names)."""
    import asyncpg

    conn = await asyncpg.connect(server_dsn)
    try:
        for name, value in THROWAWAY_SETTINGS.items():
            await conn.execute(f"ALTER SYSTEM SET {name} = {value}")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


async def migrated_database(server_dsn: str, database: str) -> str:
    import asyncpg

    from .store.migrations import migrate

    conn = await asyncpg.connect(server_dsn)
    refused = None
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{database}"')
    except asyncpg.InsufficientPrivilegeError as exc:  # asyncpg's words named no way out
        refused = str(exc)
    finally:
        await conn.close()
    if refused is not None:
        pytest.fail(
            f"idem_postgres_dsn: {refused} (database {database!r}, on the server of {DSN_ENV}):"
            " the plugin creates a database of its own there, and drops it at the run's end, "
            f"never touching the one {DSN_ENV} names; give {DSN_ENV} a role with CREATEDB that "
            f"may drop {database!r}, or unset it for a throwaway embedded server",
            pytrace=False,
        )
    dsn = urlunsplit(urlsplit(server_dsn)._replace(path="/" + database))
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    return dsn


async def dropped(server_dsn: str, database: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(server_dsn)
    try:  # FORCE: connections a test leaked would keep it
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    finally:
        await conn.close()


#: The open transactions of clients of the test database besides the asking connection (not
#: the server's own: an autovacuum worker's ANALYZE was named beside the test's transaction).
_HOLDERS = """
SELECT pid, state, date_trunc('second', now() - xact_start) AS age, left(query, 120) AS query
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
  AND backend_type = 'client backend'
ORDER BY xact_start
"""


async def emptied(dsn: str, seconds: float) -> None:
    """Empty the library's tables. TRUNCATE waits for every transaction that touched one of
    them: a transaction a test left open outside idem_store's pool (a connection of its own, a
    server still running a request) hung the next test, and so the run, for ever."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = {int(seconds * 1000)}")
                await conn.execute(f"TRUNCATE {TABLES}")
            return
        except asyncpg.LockNotAvailableError:
            pass
        holders = "; ".join(
            f"pid {row['pid']} ({row['state']}, in a transaction for {row['age']}): last "
            f"statement {row['query']!r}"
            for row in await conn.fetch(_HOLDERS)
        )
        pytest.fail(
            f"the idempotency tables could not be emptied for this test: a transaction "
            f"outside idem_store's pool held them {seconds:g} s (an earlier test or "
            "fixture left a connection in a transaction, or a request still runs); open "
            f"transactions: {holders or 'none left'}",
            pytrace=False,
        )
    finally:
        await conn.close()
