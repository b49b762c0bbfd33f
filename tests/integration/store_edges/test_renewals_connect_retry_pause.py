"""A lease renewals' connection that cannot be opened (the server refusing new connections, a
pool `init` failing for it) is not tried again for RETRY_SECONDS: the renewals meanwhile run on
the pool without an attempt each, so a server refusing connections is not sent one more per
renewal, and the log gets one warning, not one per renewal (renewals.py `_open`'s
`_retry_at`)."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.postgres import compat

KEY = RecordKey("t", "POST /payouts", "renewed-on-the-pool")


async def test_a_failed_renewals_connect_is_not_tried_again_at_once(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts: list[str] = []

    async def refused(pool: Any, suffix: str) -> Any:
        attempts.append(suffix)
        raise OSError("connection refused")

    monkeypatch.setattr(compat, "connect_like", refused)
    caplog.set_level(logging.WARNING, logger="idem_middleware.store")
    async with PostgresStore(pool=pool, listen=False) as store:
        claimed = await store.claim_lease(KEY, b"f" * 32, retention_seconds=60, lease_seconds=30)
        assert isinstance(claimed, Claimed)
        for _ in range(3):
            assert await store.heartbeat(KEY, claimed.generation, 30)  # (on the pool)
    assert attempts == [".renew"]
    warned = [r for r in caplog.records if "renewals' connection" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]


async def test_a_reopened_store_tries_the_renewals_connection_again_at_once(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pause after a failed attempt ends with the store's close: the next open (a server
    back, an app restarted in the same process) tries the connection at its first renewal."""
    real = compat.connect_like
    attempts: list[str] = []

    async def refused_once(pool: Any, suffix: str) -> Any:
        attempts.append(suffix)
        if len(attempts) == 1:
            raise OSError("connection refused")
        return await real(pool, suffix)

    monkeypatch.setattr(compat, "connect_like", refused_once)
    store = PostgresStore(pool=pool, listen=False)
    for _ in range(2):
        async with store:
            claimed = await store.claim_lease(
                KEY, b"f" * 32, retention_seconds=60, lease_seconds=30
            )
            assert isinstance(claimed, Claimed)
            assert await store.heartbeat(KEY, claimed.generation, 30)
            await store.release(KEY, claimed.generation)
    assert attempts == [".renew", ".renew"]
