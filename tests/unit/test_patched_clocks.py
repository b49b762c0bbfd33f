"""An application's test suite that moves the wall clock (freezegun replaces `time.time` in the
`time` module, as `monkeypatch` does here): `MemoryStore`, whose clock stands for the database's
`now()`, follows it, so a test can let a retention, a lease or a token's life run out."""

from __future__ import annotations

import time

import pytest

from idem_middleware.store.base import Claimed, Existing, RecordKey, State, StoredResponse
from idem_middleware.store.memory import MemoryStore

pytestmark = pytest.mark.asyncio

KEY = RecordKey("tenant", "POST /things", "k1")


class WallClock:
    """A stand-in for freezegun: `time.time` replaced, moved by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1_700_000_000.0
        monkeypatch.setattr(time, "time", lambda: self.now)


async def _claim(store: MemoryStore) -> Claimed | Existing:
    async with store.transaction(acquire_timeout=1.0) as tx:
        claim = await tx.claim(KEY, b"fp", retention_seconds=60.0, wait_seconds=1.0)
        if isinstance(claim, Claimed):
            await tx.finish(State.SUCCEEDED, StoredResponse(201, [], b"{}", None))
        assert isinstance(claim, Claimed | Existing)
        return claim


async def test_a_record_expires_when_a_patched_wall_clock_passes_its_retention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store's default clock was `time.time` as found at import: a patched one was never
    seen, and a record outlived any travel past its retention."""
    clock = WallClock(monkeypatch)
    store = MemoryStore()
    assert isinstance(await _claim(store), Claimed)
    clock.now += 59
    assert isinstance(await _claim(store), Existing)  # replayed within its retention
    clock.now += 2
    assert isinstance(await _claim(store), Claimed)  # its retention is over: a new life


async def test_a_lease_lapses_when_a_patched_wall_clock_passes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = WallClock(monkeypatch)
    store = MemoryStore()
    claim = await store.claim_lease(KEY, b"fp", retention_seconds=60.0, lease_seconds=30.0)
    assert isinstance(claim, Claimed)
    record = await store.get(KEY)
    assert record is not None
    assert not record.lease_expired
    clock.now += 31
    record = await store.get(KEY)
    assert record is not None
    assert record.lease_expired
