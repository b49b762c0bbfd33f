"""Renewals around a settlement (heartbeat.py) and the settlement's compare-and-set (fence.py's
`Fence.settle`), on the in-memory store or a store that answers as told."""

from __future__ import annotations

import asyncio
import logging

import pytest

from idem_middleware.context import claimed_context
from idem_middleware.errors import StaleGeneration, StoreError
from idem_middleware.fence import Fence
from idem_middleware.heartbeat import keep_lease
from idem_middleware.policy import Mode
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, StoredResponse
from idem_middleware.store.memory import MemoryStore

KEY = RecordKey("t", "POST /pay", "k")
DONE = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))


class Settled:
    """A store whose renewals find the record no longer pending (settled meanwhile)."""

    def __init__(self) -> None:
        self.tries = 0

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.tries += 1
        return False


class Unreachable:
    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        raise StoreError("ConnectionRefusedError: the server is down")


@pytest.mark.parametrize("settling", [True, False], ids=["settling", "running"])
async def test_a_renewal_that_meets_the_settlement_is_no_lost_lease(
    settling: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewals go on while the outcome settles; one that finds the record settled (by that
    very settlement) ends them quietly: `lease_lost` stays clear and nothing says "lease lost".
    Before the settlement began, the same answer is a lost lease."""
    context = claimed_context(*KEY, 7, Mode.LEASE, None, None)
    store = Settled()
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        await asyncio.wait_for(
            keep_lease(
                store,
                context,
                3600,
                asyncio.Event(),
                held_until=loop.time() + 3600,
                renew_now=True,
                settling=lambda: settling,
            ),
            30,
        )
    assert store.tries == 1
    assert context.lease_lost.is_set() is not settling
    lost = [r for r in caplog.records if r.getMessage().startswith("lease lost")]
    assert len(lost) == (0 if settling else 1)


async def test_renewals_failing_while_it_settles_leave_the_verdict_to_the_settlement(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context = claimed_context(*KEY, 7, Mode.LEASE, None, None)
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        await asyncio.wait_for(
            keep_lease(
                Unreachable(),
                context,
                0.09,
                asyncio.Event(),
                held_until=loop.time() + 0.09,
                renew_now=True,
                settling=lambda: True,
            ),
            30,
        )
    assert not context.lease_lost.is_set()
    assert not [r for r in caplog.records if r.getMessage().startswith("lease lost")]


async def claimed(store: MemoryStore) -> int:
    claim = await store.claim_lease(KEY, b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    return claim.generation


async def test_a_final_outcome_is_recorded_over_an_unknown_mark_of_its_own_generation() -> None:
    """A duplicate found the lease lapsed and marked the record `unknown` (the generation
    kept): the executor's completion expected `pending` and was refused. Nobody took the
    record over, so it is recorded."""
    store = MemoryStore()
    generation = await claimed(store)
    assert await store.settle(KEY, generation, State.PENDING, Settlement(State.UNKNOWN))
    fence = Fence(store, KEY, generation, State.PENDING)
    assert await fence.record(DONE)
    record = await store.get(KEY)
    assert record is not None
    assert (record.state, record.generation) == (State.SUCCEEDED, generation)
    assert record.response == DONE.response
    assert not fence.committing  # (a compare-and-set of its own: it may be sent again)


async def test_only_a_final_outcome_of_the_records_generation_is_recorded_over_unknown() -> None:
    """A takeover (a new generation) or a reconciler's outcome (recorded first) stand; an
    `unknown`, or a release, of the executor is not sent from `unknown`, nor the outcome of a
    handler whose fenced transaction was refused."""
    store = MemoryStore()
    generation = await claimed(store)
    assert await store.settle(KEY, generation, State.PENDING, Settlement(State.UNKNOWN))
    assert not await Fence(store, KEY, generation, State.PENDING).record(Settlement(State.UNKNOWN))
    assert not await Fence(store, KEY, generation, State.PENDING).record(None)
    reconciled = Settlement(State.SUCCEEDED, StoredResponse(201, [], b'{"r": 1}'))
    assert await Fence(store, KEY, generation, State.UNKNOWN).settle(reconciled)
    assert not await Fence(store, KEY, generation, State.PENDING).record(DONE)
    record = await store.get(KEY)
    assert record is not None
    assert record.response == reconciled.response

    # A handler whose fenced transaction was refused (the record marked `unknown` first): its
    # fenced writes never happened, whatever it answered.
    third = RecordKey("t", "POST /pay", "k3")
    claim = await store.claim_lease(third, b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await store.settle(third, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
    refused = Fence(store, third, claim.generation, State.PENDING)
    with pytest.raises(StaleGeneration):
        await refused.connection()
    assert not await refused.record(DONE)
    record = await store.get(third)
    assert record is not None
    assert record.state is State.UNKNOWN

    other = RecordKey("t", "POST /pay", "k2")
    claim = await store.claim_lease(other, b"f" * 32, retention_seconds=60, lease_seconds=0.01)
    assert isinstance(claim, Claimed)
    assert await store.settle(other, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
    newer = await store.takeover(other, claim.generation, State.UNKNOWN, 30)
    assert newer is not None
    assert not await Fence(store, other, claim.generation, State.PENDING).record(DONE)


async def test_a_settlement_sent_in_the_fenced_transaction_is_committing() -> None:
    """Only a final outcome sent in the fenced transaction fails with its writes (never sent
    again alone); a release sent once that transaction rolled back is a compare-and-set of its
    own."""
    store = MemoryStore()
    generation = await claimed(store)
    fenced = Fence(store, KEY, generation, State.PENDING)
    await fenced.connection()  # (opened)
    assert await fenced.record(None)
    assert not fenced.committing

    generation = await claimed(store)
    fenced = Fence(store, KEY, generation, State.PENDING)
    await fenced.connection()
    assert await fenced.record(DONE)
    assert fenced.committing
