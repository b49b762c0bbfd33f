"""A connection the store gives back clean (only its own statements ran on it, or the message
that committed reset it) sends nothing on its way back to the pool, so nothing in its release
waits: asyncpg's `pool.release` wraps it in `asyncio.shield` all the same, a task per release
(a lease-mode request gives two back). The store runs the release in its own task instead
(`compat.release_unshielded`); any other connection still goes back through `pool.release`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State, StoredResponse

_DONE = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))


@contextmanager
def _tasks_made() -> Iterator[list[str]]:
    """The names of the coroutines of the tasks the running loop makes meanwhile."""
    loop = asyncio.get_running_loop()
    made: list[str] = []
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        made.append(getattr(coro, "__qualname__", repr(coro)))
        if previous is not None:
            return previous(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        yield made
    finally:
        loop.set_task_factory(previous)


async def test_the_stores_clean_connections_go_back_without_a_task_of_their_own(
    db_dsn: str,
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False)
    async with store:
        key = RecordKey("t", "POST /release", "unshielded")
        with _tasks_made() as made:
            assert await store.get(key) is None  # the store's own statement
            claim = await store.claim_lease(key, b"f" * 32, retention_seconds=60, lease_seconds=30)
            assert isinstance(claim, Claimed)
            async with store.fenced(key, claim.generation) as fenced:
                await fenced.connection.execute("SELECT 1")
                assert await fenced.settle(_DONE)  # with its COMMIT, the reset
            tx_key = RecordKey("t", "POST /release", "unshielded-tx")
            async with store.transaction(acquire_timeout=5) as tx:
                claimed = await tx.claim(tx_key, b"f" * 32, retention_seconds=60, wait_seconds=1)
                assert isinstance(claimed, Claimed)
                await tx.connection.execute("SELECT 1")
                await tx.finish(State.SUCCEEDED, _DONE.response)  # type: ignore[arg-type]
        # (The lease claim's own task only: it runs to its end whatever becomes of the request:
        # see closing.Executions.claim. No release made one.)
        assert made == ["PostgresStore._claim"]
        # Every one of them went back and is handed out again, with nothing left open on it.
        pool = store.pool
        assert pool.get_idle_size() == pool.get_size() == 1
        async with pool.acquire() as conn:
            assert not conn.is_in_transaction()
        record = await store.get(key)
        assert record is not None
        assert record.state is State.SUCCEEDED


async def test_a_connection_anyone_else_had_goes_back_through_the_pools_release(
    db_dsn: str,
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False)
    async with store:
        with _tasks_made() as made:
            async with store.pool.acquire() as conn:  # not the store's: reset on release
                await conn.execute("SELECT 1")
        assert made  # asyncpg's shielded release, and the reset it guards
