"""A fenced transaction that finishes opening after the execution sealed its fence (a helper
of the handler asked for it while another session held the record's row, and the execution
ended meanwhile) is closed at once and refused (StaleGeneration): nothing would ever commit or
roll it back, and it held the record's row lock (the record could not be settled) for good."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from idem_middleware.errors import StaleGeneration
from idem_middleware.fence import Fence
from idem_middleware.store import Claimed, MemoryStore
from idem_middleware.store.base import RecordKey, Settlement, State
from tests.apps import BOUND

pytestmark = pytest.mark.asyncio

KEY = RecordKey("t", "POST /payouts", "k")


async def test_a_fence_sealed_while_it_opened_is_closed_and_refused() -> None:
    store = MemoryStore()
    claim = await store.claim_lease(KEY, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    fence = Fence(store, KEY, claim.generation, State.PENDING)
    async with contextlib.AsyncExitStack() as other:
        # Another session holds the record's row: the fence's opening waits for it.
        await other.enter_async_context(store.fenced(KEY, claim.generation, State.PENDING))
        opening = asyncio.ensure_future(fence.connection())
        for _ in range(10):  # (the opening reaches the row lock and waits there)
            await asyncio.sleep(0)
        assert not opening.done()
        await fence.seal()  # the execution is over
    with pytest.raises(StaleGeneration):
        await asyncio.wait_for(opening, BOUND)
    # Nothing holds the row: the record is settled at once.
    unknown = Settlement(State.UNKNOWN)
    assert await asyncio.wait_for(store.settle(KEY, claim.generation, State.PENDING, unknown), 2)
