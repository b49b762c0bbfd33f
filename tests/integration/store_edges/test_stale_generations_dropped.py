"""Generations drawn ahead for the fast path's claims are used for one second at most
(docs/fast-path.md: "values older than one second are dropped, so generations keep roughly the
order of the claims"): a fast claim after that draws a new batch from the sequence, so its
generation is later than every one drawn meanwhile, instead of the next of an old batch
(generations.py `take_ready`'s max_age)."""

from __future__ import annotations

import time
import types
import uuid

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.postgres import generations


async def _claim(store: PostgresStore) -> int:
    k = RecordKey("tenant-a", "POST /x", uuid.uuid4().hex)
    async with store.transaction(acquire_timeout=5.0) as session:
        claimed = await session.claim(k, b"f" * 32, retention_seconds=60.0, wait_seconds=0.2)
        assert isinstance(claimed, Claimed)
        return claimed.generation  # (not completed: rolled back)


async def test_generations_drawn_over_a_second_ago_are_not_used(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    async with store:
        first = await _claim(store)  # (draws a batch: its next values wait for later claims)
        assert first + 1 == await _claim(store)  # (one second has not passed: the batch's next)
        conn = await asyncpg.connect(db_dsn)
        try:
            drawn = await conn.fetchval("SELECT nextval('idem_generation_seq')")
        finally:
            await conn.close()
        later = time.monotonic() + 2.0
        clock = types.SimpleNamespace(monotonic=lambda: later)  # (this module's clock only)
        monkeypatch.setattr(generations, "time", clock)
        assert await _claim(store) > drawn
