"""Lease renewals' own connection (store/postgres/renewals.py): outside the pool, made as the
pool makes its own (its search_path too), opened again after the server ended it, bounded when
its statement hangs, closed with the store. Real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.migrations import migrate
from idem_middleware.store.postgres import compat
from tests.apps import BOUND
from tests.conftest import _fresh_database

KEY = RecordKey("t", "POST /payouts", "renewed")
SCHEMA = "renewals here"
SETTINGS = {"search_path": '"renewals here"'}


async def _claim(store: PostgresStore, key: RecordKey = KEY) -> int:
    claimed = await store.claim_lease(key, b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claimed, Claimed)
    return claimed.generation


def _pid(store: PostgresStore) -> int:
    conn = store._renewals._conn
    assert conn is not None
    assert not conn.is_closed()
    pid: int = conn.get_server_pid()
    return pid


async def _gone(pool: asyncpg.Pool[Any], pid: int) -> None:
    for _ in range(int(BOUND / 0.02)):
        if not await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"backend {pid} is still there")


async def test_renewals_run_on_a_connection_of_their_own_and_the_close_closes_it(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1) as store:
        generation = await _claim(store)
        assert await store.heartbeat(KEY, generation, 30)
        pid = _pid(store)
        async with store.pool.acquire() as held:  # (the pool's only connection)
            assert await held.fetchval("SELECT pg_backend_pid()") != pid
            assert await store.heartbeat(KEY, generation, 30)
        name = await pool.fetchval(
            "SELECT application_name FROM pg_stat_activity WHERE pid = $1", pid
        )
        assert name == "idem_middleware.renew"
        conn = store._renewals._conn
    assert conn.is_closed()
    await _gone(pool, pid)


async def test_a_store_given_a_pool_closes_the_renewals_connection_and_not_the_pool(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    async with PostgresStore(pool=pool) as store:
        generation = await _claim(store)
        assert await store.heartbeat(KEY, generation, 30)
        pid = _pid(store)
    await _gone(pool, pid)
    assert await pool.fetchval("SELECT 1") == 1
    # (Used after its close, a store given a pool renews on the pool, opening nothing.)
    assert await store.heartbeat(KEY, generation, 30)
    assert store._renewals._conn is None


class Unaware:
    """A connection that says it is open, whatever the server did."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def is_closed(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.parametrize("idle", [True, False], ids=["noticed", "unnoticed"])
async def test_a_renewals_connection_the_server_ended_is_opened_again(
    db_dsn: str, pool: asyncpg.Pool[Any], idle: bool
) -> None:
    """`pg_terminate_backend` (a DBA, a failover): the next renewal opens another connection,
    whether the driver noticed the end already or its statement is the first to find it."""
    async with PostgresStore(dsn=db_dsn) as store:
        generation = await _claim(store)
        assert await store.heartbeat(KEY, generation, 30)
        pid = _pid(store)
        if not idle:  # as if the driver had not read the end yet
            store._renewals._conn = Unaware(store._renewals._conn)
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
        await _gone(pool, pid)
        assert await store.heartbeat(KEY, generation, 30)
        assert _pid(store) != pid
        before = await pool.fetchval("SELECT lease_expires_at FROM idem_requests")
        assert await store.heartbeat(KEY, generation, 30)
        assert await pool.fetchval("SELECT lease_expires_at FROM idem_requests") > before


async def test_a_hung_renewal_is_bounded_and_its_connection_replaced(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    """A renewal's statement waiting behind DDL's table lock: it fails within a third of the
    lease (StoreError), as do the renewals queued behind it, instead of holding every lease's
    renewals; the server cancels its statement (its backend ends while the lock is still held,
    nothing lands late), and the next renewal, once the lock is gone, renews on a new one."""
    async with PostgresStore(dsn=db_dsn) as store:
        generation = await _claim(store)
        other = await _claim(store, RecordKey("t", "POST /payouts", "other"))
        assert await store.heartbeat(KEY, generation, 30)
        pid = _pid(store)
        async with pool.acquire() as ddl, ddl.transaction():
            await ddl.execute("LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE")
            renewals = [
                store.heartbeat(KEY, generation, 0.6),
                store.heartbeat(RecordKey("t", "POST /payouts", "other"), other, 0.6),
            ]
            failed = await asyncio.wait_for(
                asyncio.gather(*renewals, return_exceptions=True), BOUND
            )
            await _gone(pool, pid)
        assert [type(e) for e in failed] == [StoreError, StoreError], failed
        assert "took more than 0.2 s" in str(failed[0])
        assert await store.heartbeat(KEY, generation, 30)
        assert _pid(store) != pid


@pytest.fixture(scope="module")
async def schema_dsn(pg_dsn: str) -> AsyncIterator[str]:
    """A database whose library tables are in a schema the default search_path does not reach."""
    dsn = await _fresh_database(pg_dsn, "idem_test_renewals")
    conn = await asyncpg.connect(dsn, server_settings=SETTINGS)
    try:
        await conn.execute(f'CREATE SCHEMA "{SCHEMA}"')
        await migrate(conn)
    finally:
        await conn.close()
    yield dsn
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute('DROP DATABASE "idem_test_renewals" WITH (FORCE)')
    finally:
        await admin.close()


async def _set_path(conn: Any) -> None:
    await conn.execute(f"SET search_path TO {SETTINGS['search_path']}")


async def _keep(conn: Any) -> None:
    """A pool reset that keeps the session's settings (asyncpg's own runs RESET ALL)."""


SESSIONS: dict[str, dict[str, Any]] = {
    "pool-server-settings": {"server_settings": SETTINGS},
    "pool-init": {"init": _set_path, "reset": _keep},
    "pool-setup": {"setup": _set_path},
}


@pytest.mark.parametrize("session", [*SESSIONS, "dsn"])
async def test_the_renewals_connection_has_the_pools_session(schema_dsn: str, session: str) -> None:
    """The heartbeat's table is found by the search_path: the renewals' connection gets the
    pool's (a given pool's `server_settings`, `init` or `setup`; a DSN store's connect_kwargs)."""
    if session == "dsn":
        store = PostgresStore(dsn=schema_dsn, connect_kwargs={"server_settings": SETTINGS})
        given = None
    else:
        given = await asyncpg.create_pool(schema_dsn, min_size=1, max_size=2, **SESSIONS[session])
        store = PostgresStore(pool=given)
    try:
        async with store:
            key = RecordKey("t", "POST /payouts", session)
            generation = await _claim(store, key)
            assert await store.heartbeat(key, generation, 30)
            path = await store._renewals._conn.fetchval("SHOW search_path")
            assert path == SETTINGS["search_path"]
    finally:
        if given is not None:
            await given.close()


async def test_a_pool_that_does_not_say_how_it_connects_renews_on_the_pool(
    db_dsn: str, pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An asyncpg whose pool keeps its connect arguments elsewhere: renewals use the pool."""

    async def unknown(pool: Any, suffix: str) -> None:
        return None

    monkeypatch.setattr(compat, "connect_like", unknown)
    async with PostgresStore(pool=pool) as store:
        generation = await _claim(store)
        assert await store.heartbeat(KEY, generation, 30)
        assert await store.heartbeat(KEY, generation, 30)
        assert store._renewals._conn is None


async def test_a_renewal_the_server_refuses_keeps_the_connection(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    """A statement refused on a connection that is fine (here an interval out of range) costs
    no new connection at the next renewal."""
    async with PostgresStore(dsn=db_dsn) as store:
        generation = await _claim(store)
        assert await store.heartbeat(KEY, generation, 30)
        pid = _pid(store)
        with pytest.raises(asyncpg.PostgresError):
            await store.heartbeat(KEY, generation, 1e300)
        assert _pid(store) == pid
        assert await store.heartbeat(KEY, generation, 30)
        assert _pid(store) == pid
