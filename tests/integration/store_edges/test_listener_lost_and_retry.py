"""The LISTEN connection's two failure paths (listener.py). A listener the server ends (a
restart, an operator's pg_terminate_backend, a failover) wakes every waiter at once: they re-read
the record and poll until a new listener is up, where each would otherwise sleep out its whole
poll on a connection that can no longer wake it (`_lost`). And a connection attempt that fails
is not tried again for RETRY_SECONDS: every waiter that arrives meanwhile polls without starting
an attempt of its own, so a server refusing the listener is not sent one connection (and the
log one warning) per waiter (`_connect`'s `_retry_at`)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store.base import RecordKey


def _key() -> RecordKey:
    return RecordKey("tenant-a", "POST /x", uuid.uuid4().hex)


async def test_a_lost_listen_connection_wakes_its_waiters(db_dsn: str) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    admin = await asyncpg.connect(db_dsn)
    try:
        async with store, store.watch(_key()) as watch:
            for _ in range(200):  # (the listener connects in the background: at most 10 s)
                if watch.listening:
                    break
                await asyncio.sleep(0.05)
            assert watch.listening
            waiting = asyncio.create_task(watch.wait(60.0))
            await asyncio.sleep(0)  # (the wait has begun: registered, then on its event)
            ended = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND query ILIKE 'LISTEN%'"
            )
            assert ended == 1
            woken = await asyncio.wait_for(waiting, 10.0)  # (not the 60 s of its poll)
            assert woken is True
            assert not watch.listening
    finally:
        await admin.close()


async def test_a_failed_listen_connect_is_not_tried_again_by_the_next_waiter(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    missing = db_dsn.replace("/idem_test", "/idem_no_such_database")
    assert missing != db_dsn
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen_dsn=missing)
    listener: Any = store._listener
    caplog.set_level(logging.WARNING, logger="idem_middleware.store")
    async with store:
        for _ in range(3):
            async with store.watch(_key()) as watch:
                attempt = listener._connecting
                if attempt is not None:
                    await asyncio.wait_for(attempt, 10.0)
                assert not watch.listening
    failures = [r for r in caplog.records if "LISTEN unavailable" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]
