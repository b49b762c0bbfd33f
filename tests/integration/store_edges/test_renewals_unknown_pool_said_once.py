"""An asyncpg whose pool does not say how it connects: the renewals use the pool, and say so
once, until the store's next open (renewals.py `_open`: `_retry_at = math.inf`), not with a
warning and another look at the pool at every renewal of every lease."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.postgres import compat

KEY = RecordKey("t", "POST /payouts", "renewed-on-an-unknown-pool")


async def test_a_pool_that_does_not_say_how_it_connects_is_said_once(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked: list[str] = []

    async def unknown(pool: Any, suffix: str) -> None:
        asked.append(suffix)
        return None

    monkeypatch.setattr(compat, "connect_like", unknown)
    caplog.set_level(logging.WARNING, logger="idem_middleware.store")
    async with PostgresStore(pool=pool, listen=False) as store:
        claimed = await store.claim_lease(KEY, b"f" * 32, retention_seconds=60, lease_seconds=30)
        assert isinstance(claimed, Claimed)
        for _ in range(3):
            assert await store.heartbeat(KEY, claimed.generation, 30)
    assert asked == [".renew"]
    said = [r for r in caplog.records if "does not say how it connects" in r.getMessage()]
    assert len(said) == 1
