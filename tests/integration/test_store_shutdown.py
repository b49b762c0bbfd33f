"""Closing the store while a request holds one of its connections (a shutdown with requests in
flight): the request's connection still goes back to its pool, and the close completes."""

from __future__ import annotations

import asyncio

from idem_middleware import PostgresStore, RecordKey

BOUND = 10.0


async def test_a_connection_held_across_close_goes_back_to_its_pool(db_dsn: str) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    await store.open()
    closing: asyncio.Task[None] | None = None
    async with store.transaction(acquire_timeout=BOUND) as tx:
        await tx.claim(
            RecordKey("tenant-a", "POST /x", "shutdown-1"),
            b"f" * 32,
            retention_seconds=60,
            wait_seconds=1,
        )
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0.05)
        assert not closing.done(), "the pool's close waits for the connection in use"
    # Leaving the block gave the connection back (to the pool it came from, now closing).
    await asyncio.wait_for(closing, BOUND)
