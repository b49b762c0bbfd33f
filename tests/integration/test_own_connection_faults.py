"""The store's own connections outside the pool (the LISTEN connection, the lease renewals'),
made with the pool's connect arguments and callbacks, against callbacks that raise, hang or
are not what asyncpg's pool would call, and against the server ending them. Real PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.postgres import listener
from tests.apps import BOUND

KEY = RecordKey("t", "POST /payouts", "own-connections")


async def _claim(store: PostgresStore, key: RecordKey = KEY) -> int:
    claimed = await store.claim_lease(key, b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claimed, Claimed)
    return claimed.generation


async def test_a_pool_init_that_raises_on_the_listen_connection_is_polled_around_and_retried_later(
    db_dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool's `init` (or `setup`, or `connect=`) may raise anything (a config it reads, a
    codec it registers), and now runs on the LISTEN connection too: the attempt fails like a
    refused connection (a warning, waiters poll, the next attempt after RETRY_SECONDS), rather
    than escaping its task ("Task exception was never retrieved") and being tried again by
    every waiter, a connection each."""
    monkeypatch.setattr(listener, "RETRY_SECONDS", 1e6)  # (no second attempt in this test)
    opened: list[str] = []

    async def init(conn: Any) -> None:
        name = await conn.fetchval("SHOW application_name")
        if name.endswith(".listen"):
            opened.append(name)
            raise RuntimeError("no configuration for this connection")

    caplog.set_level(logging.WARNING, "idem_middleware.store")
    async with PostgresStore(dsn=db_dsn, connect_kwargs={"init": init}) as store:
        generation = await _claim(store)
        for _ in range(3):
            async with store.watch(KEY) as watch:
                assert not await watch.wait(0.01)
            attempt = store._listener._connecting
            if attempt is not None:  # (each attempt over before the next waiter)
                await asyncio.wait((attempt,))
        assert await store.heartbeat(KEY, generation, 30)
    assert opened == ["idem_middleware.listen"]
    warned = [r.getMessage() for r in caplog.records if "LISTEN unavailable" in r.getMessage()]
    assert len(warned) == 1
    assert "RuntimeError('no configuration for this connection')" in warned[0]


async def _none_left(pool: asyncpg.Pool[Any], suffix: str) -> None:
    """No backend of this database whose application_name ends with `suffix` (once the server
    has noticed the ends of those that were cut)."""
    query = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE application_name LIKE '%' || $1 AND datname = current_database()"
    )
    for _ in range(int(BOUND / 0.02)):
        if not await pool.fetchval(query, suffix):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"backends {suffix} are still there")


async def test_a_renewals_connection_that_is_slow_to_open_leaves_the_renewal_to_the_pool(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    """The renewals' connection's `init` (or its connect) hangs while the pool serves: a
    renewal waits for the opening for half its bound at most, then renews on the pool. It
    waited for the whole bound and failed, and so did the renewals after it (each started
    another attempt, as slow), until the lease was lost, although the pool could renew it."""
    hung: list[str] = []

    async def init(conn: Any) -> None:
        name = await conn.fetchval("SHOW application_name")
        if name.endswith(".renew"):
            hung.append(name)
            await asyncio.sleep(3600)  # (cancelled: CONNECT_SECONDS, or the store's close)

    async with PostgresStore(dsn=db_dsn, connect_kwargs={"init": init}) as store:
        generation = await _claim(store)
        before = await pool.fetchval(
            "SELECT lease_expires_at FROM idem_requests WHERE idem_key = $1", KEY.key
        )
        assert await store.heartbeat(KEY, generation, 30)
        after = await pool.fetchval(
            "SELECT lease_expires_at FROM idem_requests WHERE idem_key = $1", KEY.key
        )
        assert after > before
        assert hung == ["idem_middleware.renew"]
    await _none_left(pool, ".renew")
