"""An operator may resolve a lease-mode record left `pending` with its lease lapsed (its process
died) that nothing will take over: a `TAKEOVER` route without a reconciler leaves it to the
client's retry, and once the fingerprint's options changed that retry is refused `422`, so the
record stayed `pending` for good (`reconcile` passed it over, `resolve` refused it). Never one
whose lease runs, nor one renewed since the operator read it: an execution still runs it."""

from __future__ import annotations

import asyncio

import pytest

from idem_middleware.ops import Resolution, ResolveError, resolve
from idem_middleware.store import Claimed, RecordKey, State, Store, StoredResponse
from idem_middleware.store.base import Settlement

K = RecordKey("tenant-a", "POST /payouts", "k1")
DECLINED = StoredResponse(402, [(b"content-type", b"application/json")], b'{"declined": true}')


async def _pending(store: Store, lease: float) -> int:
    claim = await store.claim_lease(K, b"f", retention_seconds=60, lease_seconds=lease)
    assert isinstance(claim, Claimed)
    return claim.generation


async def test_a_lapsed_lease_is_resolved_by_hand(store: Store) -> None:
    generation = await _pending(store, 0.1)
    await asyncio.sleep(0.2)
    move = await resolve(
        store, K, Resolution.FAILED_FINAL, note="the bank declined it", response=DECLINED
    )
    assert (move.before, move.after) == (State.PENDING, State.FAILED_FINAL)
    record = await store.get(K)
    assert record is not None
    assert record.state is State.FAILED_FINAL
    assert record.generation != generation  # the dead execution's settlement is refused
    assert record.response == DECLINED
    assert not await store.settle(K, generation, State.PENDING, Settlement(State.UNKNOWN))


async def test_a_running_lease_is_not_resolved(store: Store) -> None:
    await _pending(store, 30)
    with pytest.raises(ResolveError, match="pending"):
        await resolve(store, K, Resolution.RETRY, note="guess")
    record = await store.get(K)
    assert record is not None
    assert record.state is State.PENDING


async def test_a_lease_renewed_since_it_was_read_is_not_moved(store: Store) -> None:
    """The operator read the record lapsed; its execution renewed the lease meanwhile (it was
    only slow): the store refuses the move."""
    generation = await _pending(store, 0.1)
    await asyncio.sleep(0.2)
    assert await store.heartbeat(K, generation, 30)  # renewed
    line = Settlement(State.PENDING, None, note="released by hand")
    assert not await store.amend(K, generation, State.PENDING, line)
    record = await store.get(K)
    assert record is not None
    assert (record.state, record.generation) == (State.PENDING, generation)


async def test_a_record_released_for_a_retry_is_resolved_by_hand(store: Store) -> None:
    """Released for the client's retry (no lease: nobody runs it), and the retry never lands
    (refused `422` after a fingerprint change, or never sent): an operator settles it to an
    outcome. (It stayed `pending` for good: nothing else moves it.)"""
    generation = await _pending(store, 30)
    assert await store.settle(K, generation, State.PENDING, Settlement(State.UNKNOWN))
    assert await store.allow_retry(K, generation, "reconciled: not happened")
    released = await store.get(K)
    assert released is not None
    assert (released.state, released.retry_allowed) == (State.PENDING, True)
    with pytest.raises(ResolveError, match="released for the client's retry already"):
        await resolve(store, K, Resolution.RETRY, note="again")
    move = await resolve(
        store, K, Resolution.FAILED_FINAL, note="the bank declined it", response=DECLINED
    )
    assert (move.before, move.after) == (State.PENDING, State.FAILED_FINAL)
    record = await store.get(K)
    assert record is not None
    assert record.state is State.FAILED_FINAL
    assert record.response == DECLINED
