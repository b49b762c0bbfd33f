"""The LISTEN connection is made again by itself once it was up and was lost (listener.py:
`_lost`, `_retry`), and a wait that began while the server was away makes it at its next poll.

Without this, a listener lost in a database restart was made again only when a new wait began;
with every duplicate of a process waiting in-process for a while (`Waiters.held`: a key a
transactional attempt or a lease execution of this process holds), nothing began one, and a
duplicate of another process's key found no listener: it polled instead of being woken.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store.base import RecordKey
from idem_middleware.store.postgres import listener as listener_module

_LISTEN_BACKENDS = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    " AND query ILIKE 'LISTEN%'"
)


@pytest.fixture
async def admin(db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of the test's own, which ends the listener's session."""
    conn = await asyncpg.connect(db_dsn)
    try:
        yield conn
    finally:
        await conn.close()


def _key() -> RecordKey:
    return RecordKey("tenant-a", "POST /x", uuid.uuid4().hex)


async def _until(predicate: Any, what: str, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def _listening(store: PostgresStore) -> Any:
    """The store's listener, connected by a wait that ended (none runs afterwards)."""
    listener: Any = store._listener
    async with store.watch(_key()):
        await _until(listener.connected, "the listener")
    return listener


async def _end_listen_backends(admin: asyncpg.Connection) -> None:
    ended = await admin.fetchval(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND query ILIKE 'LISTEN%'"
    )
    assert ended == 1


class Failing:
    """The listener's `connect`, failing its first `failures` calls (a server still away)."""

    def __init__(self, connect: Any, failures: int) -> None:
        self.connect = connect
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionRefusedError("the server is away")
        return await self.connect()


async def test_a_lost_listener_is_made_again_with_no_wait_begun(
    db_dsn: str, admin: asyncpg.Connection
) -> None:
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2) as store:
        listener = await _listening(store)
        first = listener._conn
        await _end_listen_backends(admin)
        await _until(
            lambda: listener._conn is not first and listener.connected(),
            "the listener made again",
        )
        assert first.is_closed()
        assert await admin.fetchval(_LISTEN_BACKENDS) == 1


async def test_after_a_loss_failed_attempts_are_retried_every_retry_seconds(
    db_dsn: str, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listener_module, "RETRY_SECONDS", 0.1)
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2) as store:
        listener = await _listening(store)
        failing = listener._open_connection = Failing(listener._open_connection, 3)
        await _end_listen_backends(admin)
        await _until(
            lambda: failing.calls == 4 and listener.connected(),
            "the listener made again, after three failures",
        )
        assert listener._retrying is None  # (connected: no retry is due)


async def test_closing_the_store_stops_the_retries(
    db_dsn: str, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listener_module, "RETRY_SECONDS", 0.05)
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    async with store:
        listener = await _listening(store)
        failing = listener._open_connection = Failing(listener._open_connection, 10**6)
        await _end_listen_backends(admin)
        await _until(lambda: failing.calls >= 2, "a retry after the first failure")
    assert listener._retrying is None
    calls = failing.calls
    await asyncio.sleep(0.3)  # (six retries' worth)
    assert failing.calls == calls


async def test_a_wait_begun_while_the_server_was_away_connects_at_a_later_poll(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never connected yet (no loss: nothing retries by itself), its first attempt failed: the
    wait's next poll, once RETRY_SECONDS have passed, makes the connection."""
    monkeypatch.setattr(listener_module, "RETRY_SECONDS", 0.1)
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2) as store:
        listener: Any = store._listener
        failing = listener._open_connection = Failing(listener._open_connection, 1)
        async with store.watch(_key()) as watch:
            for _ in range(100):  # (polls of 50 ms: at most 5 s)
                if listener.connected():
                    break
                await watch.wait(0.05)
            assert listener.connected()
        assert failing.calls == 2


async def test_an_idle_session_timeout_does_not_end_the_listener(db_dsn: str) -> None:
    """A role's or database's `idle_session_timeout` (here the pool's server_settings, which the
    listener's connection is made with too) would end the idle LISTEN session again and again."""
    settings = {"server_settings": {"idle_session_timeout": "200"}}
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2, connect_kwargs=settings) as store:
        listener = await _listening(store)
        first = listener._conn
        await asyncio.sleep(0.8)  # (four timeouts' worth)
        assert listener._conn is first
        assert not first.is_closed()
        assert await first.fetchval("SHOW idle_session_timeout") == "0"


class EndingAfterListen:
    """A connection the server ends just as its LISTEN is answered (both in one read: the
    connection is cleaned up before the listener's code runs on)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def add_listener(self, *args: Any) -> None:
        await self._conn.add_listener(*args)
        self._conn.terminate()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def test_a_listener_ended_as_it_was_made_is_made_again(
    db_dsn: str, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its termination listener, added to a connection already cleaned up, would never be
    called: the listener stayed down, with nothing to retry it until a wait began."""
    monkeypatch.setattr(listener_module, "RETRY_SECONDS", 0.1)
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2) as store:
        listener = await _listening(store)
        first = listener._conn
        connect, calls = listener._open_connection, []

        async def ending_once() -> Any:
            calls.append(1)
            conn = await connect()
            return EndingAfterListen(conn) if len(calls) == 1 else conn

        listener._open_connection = ending_once
        await _end_listen_backends(admin)
        await _until(
            lambda: listener._conn not in (None, first) and listener.connected(),
            "the listener made again, after the one that ended as it was made",
        )
        assert len(calls) == 2
        assert await admin.fetchval(_LISTEN_BACKENDS) == 1
