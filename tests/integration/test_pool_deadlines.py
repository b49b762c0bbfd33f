"""A transaction session's waits for the pool are bounded by its acquire timeout, with one timer
for all sessions (store/postgres/sessions.py): a checkout that finds no free connection gives
up, and a connection that cannot come back (its server stopped answering during the rollback
or the reset) is terminated rather than holding the request forever. The unresponsive server
is real: its backend process is stopped with SIGSTOP and resumed afterwards."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from idem_middleware import PostgresStore, RecordKey, StoreError
from idem_middleware.store.base import Claimed

BOUND = 10.0
DEADLINE = 0.3


def _key(name: str) -> RecordKey:
    return RecordKey("tenant-a", "POST /x", name)


async def test_a_checkout_with_no_free_connection_gives_up_at_its_deadline(db_dsn: str) -> None:
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
        held = await store.pool.acquire()
        try:

            async def checkout() -> None:
                async with store.transaction(acquire_timeout=DEADLINE):
                    raise AssertionError("no connection was free")  # pragma: no cover

            with pytest.raises(StoreError, match="no database connection"):
                await asyncio.wait_for(checkout(), BOUND)  # (TimeoutError: it never gave up)
        finally:
            await store.pool.release(held)
        # The deadline left nothing behind: the next checkout gets the connection.
        async with store.transaction(acquire_timeout=DEADLINE) as tx:
            claim = await tx.claim(_key("after"), b"f" * 32, retention_seconds=60, wait_seconds=1)
            assert isinstance(claim, Claimed)


async def test_a_cancelled_checkout_stays_cancelled(db_dsn: str) -> None:
    """A cancellation that is not the deadline's (a shutdown) is not turned into a timeout."""
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
        held = await store.pool.acquire()
        try:

            async def checkout() -> None:
                async with store.transaction(acquire_timeout=BOUND):
                    pass  # pragma: no cover

            task = asyncio.ensure_future(checkout())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, BOUND)
        finally:
            await store.pool.release(held)


async def test_a_connection_whose_server_stops_answering_is_terminated_on_its_way_back(
    db_dsn: str,
) -> None:
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
        backend = 0

        async def stop_inside() -> None:
            nonlocal backend
            async with store.transaction(acquire_timeout=DEADLINE) as tx:
                await tx.claim(_key("stopped"), b"f" * 32, retention_seconds=60, wait_seconds=1)
                backend = tx.connection.get_server_pid()
                os.kill(backend, signal.SIGSTOP)
            # Leaving the block rolled back, stuck (the server is stopped) until the deadline
            # terminated the connection.

        task = asyncio.ensure_future(stop_inside())
        try:
            # (Not wait_for: cancelling a task stuck on a stopped server waits on it too.)
            await asyncio.wait({task}, timeout=BOUND)
            assert task.done(), "leaving the block stayed stuck on the stopped server"
        finally:
            if backend:
                os.kill(backend, signal.SIGCONT)
            await asyncio.wait_for(task, BOUND)
        # The pool replaced the terminated connection, and the key was never recorded.
        async with store.transaction(acquire_timeout=BOUND) as tx:
            claim = await tx.claim(_key("stopped"), b"f" * 32, retention_seconds=60, wait_seconds=1)
            assert isinstance(claim, Claimed)
            assert tx.connection.get_server_pid() != backend


async def test_a_deadline_that_fires_once_the_connection_is_back_touches_nothing(
    db_dsn: str,
) -> None:
    """The timer may fire between the pool taking the connection back and the session hearing
    of it: the session's connection is then a released proxy, and the pool's connection, lent
    to the next checkout, must not be terminated."""
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
        async with store.transaction(acquire_timeout=BOUND) as done:
            await done.claim(_key("back"), b"f" * 32, retention_seconds=60, wait_seconds=1)
        async with store.transaction(acquire_timeout=BOUND) as tx:
            backend = tx.connection.get_server_pid()
            done.due()  # (what the timer would call)
            claim = await tx.claim(_key("next"), b"f" * 32, retention_seconds=60, wait_seconds=1)
            assert isinstance(claim, Claimed)
            assert tx.connection.get_server_pid() == backend
