"""Lease-mode settlements around the store's close: a store that is closed (or was never
opened) refuses work for good, so a settlement that meets it is not sent again as if it had met
a blip (resettle.py); and a shutdown while the database is down stays within its bound."""

from __future__ import annotations

import asyncio

import pytest

from idem_middleware import IdempotencyContext
from idem_middleware.errors import StoreClosed, StoreError
from idem_middleware.jobs import idempotent_job
from idem_middleware.policy import Mode
from idem_middleware.resettle import blip
from idem_middleware.store.base import RecordKey, State
from tests.integration.test_settlement_blips import BOUND, SettleLog

#: Long enough that sending a settlement again for a third of it would show.
LEASE_SECONDS = 3.0


def test_a_closed_store_is_no_blip() -> None:
    assert not blip(StoreClosed("the store is closed"))
    assert blip(StoreError("ConnectionRefusedError: the server is down"))


async def test_a_job_that_ends_after_the_store_closed_is_not_sent_again(db_dsn: str) -> None:
    """A job (a queue consumer's, which the store's close does not wait for) ends after the
    store closed: its settlement met "the store is closed", taken for a blip, and was sent
    again with backoff for a third of its lease, every try refused the same way, before the
    job's caller got the StoreError. Now the first refusal stands."""
    entered, release = asyncio.Event(), asyncio.Event()
    store = SettleLog(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.settlements = []
    await store.open()

    @idempotent_job(
        store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=LEASE_SECONDS
    )
    async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return {"paid": ref}

    running = asyncio.create_task(payout(ref="after-close"))
    await asyncio.wait_for(entered.wait(), BOUND)
    await asyncio.wait_for(store.close(), BOUND)
    release.set()
    with pytest.raises(StoreClosed, match="the store is closed"):
        await asyncio.wait_for(running, BOUND)
    # One try at the outcome, one at marking it unknown: neither sent again.
    assert store.settlements == [(State.SUCCEEDED, False), (State.UNKNOWN, False)]
    async with SettleLog(dsn=db_dsn, min_size=1, max_size=1, listen=False) as reader:
        record = await reader.get(RecordKey("", "payout", "after-close"))
    assert record is not None
    assert record.state is State.PENDING  # (until its lease lapses: nothing could mark it)
