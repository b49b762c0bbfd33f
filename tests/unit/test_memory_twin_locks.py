"""The twin's row lock as PostgreSQL's: a statement locks (or waits for) only a row it matches.
While a session holds a record's row, a move under another generation (or from another state)
is answered at once, as on PostgreSQL, not busy (`ClaimBusy`) or waited for; and `list_records`
refuses a negative limit the same way on both stores. Each test runs on both (`harness`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware.errors import ClaimBusy, StaleGeneration
from idem_middleware.ops import Resolution, ResolveError, resolve
from idem_middleware.store import Claimed, RecordKey, State, StoredResponse
from idem_middleware.store.base import Settlement
from tests.contract import Harness
from tests.contract import claim as claim_in

K = RecordKey("t", "POST /p", "k")
OTHER = 1000  # added to the record's generation: a generation that does not hold it
#: What a move answered at once takes at most (a wait for the row lock is never answered).
AT_ONCE = 2.0


async def _pending(harness: Harness, *, lapsed: bool = False) -> int:
    claim = await harness.store.claim_lease(K, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    if lapsed:
        await harness.lapse(K)
    return claim.generation


async def _unknown(harness: Harness) -> int:
    generation = await _pending(harness)
    assert await harness.store.settle(K, generation, State.PENDING, Settlement(State.UNKNOWN))
    return generation


async def _at_once(move: Any) -> Any:
    return await asyncio.wait_for(move, AT_ONCE)


async def test_expire_lease_under_another_generation_while_fenced_is_false(
    harness: Harness,
) -> None:
    store = harness.store
    generation = await _pending(harness, lapsed=True)
    async with store.fenced(K, generation):
        assert await _at_once(store.expire_lease(K, generation + OTHER)) is False
        with pytest.raises(ClaimBusy):  # its own generation: the held row is busy
            await _at_once(store.expire_lease(K, generation))
    assert await store.expire_lease(K, generation) is True


async def test_expire_lease_not_lapsed_while_fenced_is_false(harness: Harness) -> None:
    store = harness.store
    generation = await _pending(harness)  # its lease runs
    async with store.fenced(K, generation):
        assert await _at_once(store.expire_lease(K, generation)) is False


async def test_takeover_under_another_generation_while_fenced_is_none(harness: Harness) -> None:
    store = harness.store
    generation = await _pending(harness, lapsed=True)
    async with store.fenced(K, generation):
        taken = store.takeover(K, generation + OTHER, State.PENDING, 30)
        assert await _at_once(taken) is None
        with pytest.raises(ClaimBusy):
            await _at_once(store.takeover(K, generation, State.PENDING, 30))


async def test_allow_retry_of_a_pending_record_while_fenced_is_false_at_once(
    harness: Harness,
) -> None:
    store = harness.store
    generation = await _pending(harness)
    async with store.fenced(K, generation):
        assert await _at_once(store.allow_retry(K, generation, "no")) is False


async def test_a_reconcilers_fence_under_another_generation_is_stale_while_another_holds_it(
    harness: Harness,
) -> None:
    store = harness.store
    generation = await _unknown(harness)
    async with store.fenced(K, generation, State.UNKNOWN):
        with pytest.raises(StaleGeneration):
            await _at_once(_enter(store.fenced(K, generation + OTHER, State.UNKNOWN)))
        with pytest.raises(ClaimBusy):  # its own generation: held by the other fence
            await _at_once(_enter(store.fenced(K, generation, State.UNKNOWN)))


async def test_an_executors_fence_under_another_generation_is_stale_at_once(
    harness: Harness,
) -> None:
    store = harness.store
    generation = await _pending(harness)
    async with store.fenced(K, generation):
        with pytest.raises(StaleGeneration):
            await _at_once(_enter(store.fenced(K, generation + OTHER)))


async def test_settle_and_release_under_another_generation_while_fenced_are_false_at_once(
    harness: Harness,
) -> None:
    store = harness.store
    generation = await _pending(harness)
    async with store.fenced(K, generation):
        done = Settlement(State.UNKNOWN)
        assert await _at_once(store.settle(K, generation + OTHER, State.PENDING, done)) is False
        assert await _at_once(store.release(K, generation + OTHER)) is False
    record = await store.get(K)
    assert record is not None
    assert (record.state, record.generation) == (State.PENDING, generation)


async def _enter(fenced: Any) -> None:
    async with fenced:
        pass


@pytest.mark.parametrize("limit", [-1, -100, 1.5, True], ids=["-1", "-100", "float", "bool"])
async def test_list_records_refuses_a_limit_that_is_no_count(harness: Harness, limit: Any) -> None:
    """The twin kept all but the last records (a negative slice); PostgreSQL raised asyncpg's
    own error. Both refuse it, with the same message, before reading anything."""
    await _unknown(harness)
    with pytest.raises(ValueError, match="list_records: limit must be a whole number from 0"):
        await harness.store.list_records(states=[State.UNKNOWN], limit=limit)
    assert await harness.store.list_records(states=[State.UNKNOWN], limit=0) == []
    assert len(await harness.store.list_records(states=[State.UNKNOWN], limit=1)) == 1


async def test_an_operators_move_waits_for_a_transaction_claiming_the_key_again(
    harness: Harness,
) -> None:
    """A record whose retention is over, claimed again by a transaction still running: an
    operator's re-resolve waits for it (PostgreSQL's UPDATE waits for the row it locked), then
    finds the record taken over and is refused. The twin answered at once that the move was
    made, and the claim's outcome then replaced it."""

    store = harness.store
    async with harness.transaction() as tx:
        assert isinstance(await claim_in(tx, K), Claimed)
        await tx.finish(State.SUCCEEDED, StoredResponse(201, [], b'{"run": 1}'))
    await harness.end_retention(K)
    async with harness.transaction() as tx:
        assert isinstance(await claim_in(tx, K), Claimed)  # the retention over: claimed again
        moving = asyncio.create_task(
            resolve(
                store,
                K,
                Resolution.SUCCEEDED,
                note="the bank says so",
                response=StoredResponse(
                    201, [(b"content-type", b"application/json")], b'{"run": 0}'
                ),
                again=True,
            )
        )
        await asyncio.sleep(0.2)
        assert not moving.done()  # waiting for the claim's row
        await tx.finish(State.SUCCEEDED, StoredResponse(201, [], b'{"run": 2}'))
    with pytest.raises(ResolveError, match="changed"):
        await asyncio.wait_for(moving, AT_ONCE)
    record = await store.get(K)
    assert record is not None
    assert record.response is not None
    assert record.response.body == b'{"run": 2}'
