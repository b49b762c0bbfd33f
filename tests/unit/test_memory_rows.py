"""The in-memory store keeps its committed records in a form the garbage collector stops
tracking, and reads them back unchanged."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from idem_middleware.errors import ClaimBusy
from idem_middleware.store.base import Claimed, Existing, Record, RecordKey, State, StoredResponse
from idem_middleware.store.memory import MemoryStore, _Row

pytestmark = pytest.mark.asyncio

HEADERS = [(b"content-type", b"application/json"), (b"x-trace", b"\xff\x00")]


async def _commit(store: MemoryStore, key: RecordKey, body: bytes) -> None:
    async with store.transaction(acquire_timeout=1.0) as tx:
        await tx.claim(key, b"fp-" + body, retention_seconds=60.0, wait_seconds=1.0)
        await tx.finish(State.SUCCEEDED, StoredResponse(201, HEADERS, body, None))


async def test_committed_records_are_untracked_before_the_oldest_generation() -> None:
    """A young collection and then a middle-aged one, as a record lives through them in a
    running app: by then none of its objects is tracked, so none moves to the oldest generation
    (whose growth brings on the collections of the whole heap)."""
    store = MemoryStore()
    keys = [RecordKey("tenant", "POST /things", f"k{i}") for i in range(50)]
    gc.collect()
    gc.disable()  # the two collections below are the only ones they live through
    try:
        for i, key in enumerate(keys):
            await _commit(store, key, b'{"n": %d}' % i)
        gc.collect(0)
        gc.collect(1)
    finally:
        gc.enable()
    packed = store._rows._packed
    assert len(packed) == 50
    still_tracked = [k for k, v in packed.items() if gc.is_tracked(k) or gc.is_tracked(v)]
    assert still_tracked == []


async def test_records_read_back_as_committed() -> None:
    store = MemoryStore()
    key = RecordKey("tenant", "POST /things", "k1")
    await _commit(store, key, b'{"n": 1}')
    gc.collect()
    record = await store.get(key)
    assert record is not None
    assert record.key == key
    assert type(record.key) is RecordKey
    assert record.state is State.SUCCEEDED
    assert record.fingerprint == b'fp-{"n": 1}'
    assert record.response == StoredResponse(201, HEADERS, b'{"n": 1}', None)
    assert [summary.key for summary in await store.list_records(states=[State.SUCCEEDED])] == [key]


async def test_a_row_read_is_a_copy_changes_are_stored_back() -> None:
    store = MemoryStore()
    key = RecordKey("tenant", "POST /things", "k1")
    store._rows[key] = _Row(b"fp", State.PENDING, 7, 60.0, mode="lease", note="first")
    row = store._rows[key]
    row.note = "changed in the copy only"
    assert store._rows[key].note == "first"
    assert key in store._rows
    assert len(store._rows) == 1
    del store._rows[key]
    assert store._rows.get(key) is None


RESPONSES = [None, StoredResponse(500, [], b"", "too-large"), StoredResponse(201, HEADERS, b"x")]


@pytest.mark.parametrize("response", RESPONSES)
async def test_every_field_of_a_row_survives_the_round_trip(
    response: StoredResponse | None,
) -> None:
    store = MemoryStore()
    key = RecordKey("tenant", "POST /things", "k1")
    row = _Row(
        b"fp",
        State.UNKNOWN,
        7,
        60.0,
        expires_at=1.5,
        response=response,
        mode="lease",
        lease_expires_at=2.5,
        created_at=3.5,
        updated_at=4.5,
        note="a note",
        epoch=5,
    )
    store._rows[key] = row
    assert store._rows[key] == row
    assert [(k, r) for k, r in store._rows.items()] == [(key, row)]
    assert all(type(k) is RecordKey for k, _ in store._rows.items())  # not a plain tuple


@pytest.mark.parametrize(
    "pairs",
    [
        [[b"content-type", b"application/json"], [b"x-a", b"1"]],  # lists, as ASGI allows
        [(b"x-%d" % i, b"%d" % i) for i in range(40)],  # more than are joined by `sum`
        [],
    ],
    ids=["list-pairs", "many-pairs", "none"],
)
async def test_headers_of_any_shape_are_kept_flat_and_read_back_as_pairs(
    pairs: list[Any],
) -> None:
    store = MemoryStore()
    key = RecordKey("tenant", "POST /things", "k1")
    await _commit_headers(store, key, pairs)
    packed = store._rows._packed[tuple(key)]
    assert all(type(part) is bytes for part in packed[12])  # flat: names and values only
    record = await store.get(key)
    assert record is not None
    assert record.response is not None
    assert record.response.headers == [tuple(pair) for pair in pairs]


async def _commit_headers(store: MemoryStore, key: RecordKey, pairs: list[Any]) -> None:
    async with store.transaction(acquire_timeout=1.0) as tx:
        await tx.claim(key, b"fp", retention_seconds=60.0, wait_seconds=1.0)
        await tx.finish(State.SUCCEEDED, StoredResponse(201, pairs, b"{}", None))


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_committed_claim_is_the_row_its_claim_and_outcome_make() -> None:
    """A claim stages four fields and the outcome is packed straight from them: the record read
    back is the row the claim and the completion describe, field by field."""
    clock = _Clock()
    store = MemoryStore(clock=clock)
    key = RecordKey("tenant", "POST /things", "k1")
    response = StoredResponse(201, HEADERS, b'{"n": 1}', None)
    async with store.transaction(acquire_timeout=1.0) as tx:
        claim = await tx.claim(key, b"fp", retention_seconds=60.0, wait_seconds=1.0)
        assert isinstance(claim, Claimed)
        clock.now += 2.0
        await tx.finish(State.SUCCEEDED, response)
    assert store._rows[key] == _Row(
        b"fp",
        State.SUCCEEDED,
        claim.generation,
        60.0,
        expires_at=1062.0,
        response=response,
        mode="transactional",
        created_at=1000.0,
        updated_at=1002.0,
        epoch=claim.generation,
    )


async def test_a_transaction_claiming_twice_sees_its_own_claim_and_commits_both() -> None:
    """The earlier claim of a transaction is read back by its later claim of the same key as
    pending, and commits as the pending record it is when the transaction completes another."""
    clock = _Clock()
    store = MemoryStore(clock=clock)
    first, second = (RecordKey("tenant", "POST /things", k) for k in ("k1", "k2"))
    async with store.transaction(acquire_timeout=1.0) as tx:
        claimed = await tx.claim(first, b"fp1", retention_seconds=60.0, wait_seconds=1.0)
        assert isinstance(claimed, Claimed)
        again = await tx.claim(first, b"fp1", retention_seconds=60.0, wait_seconds=1.0)
        assert isinstance(again, Existing)
        assert again.record == Record(
            first, b"fp1", State.PENDING, claimed.generation, None, epoch=claimed.generation
        )
        assert isinstance(
            await tx.claim(second, b"fp2", retention_seconds=9.0, wait_seconds=1.0), Claimed
        )
        await tx.finish(State.SUCCEEDED, StoredResponse(201, HEADERS, b"{}", None))
    pending = store._rows[first]
    assert (pending.state, pending.generation, pending.epoch, pending.response) == (
        State.PENDING,
        claimed.generation,
        claimed.generation,
        None,
    )
    assert (pending.retention, pending.created_at, pending.mode) == (60.0, 1000.0, "transactional")
    assert store._rows[second].state is State.SUCCEEDED
    assert list(store._rows._packed) == [tuple(first), tuple(second)]  # in the order claimed


async def test_a_transaction_claiming_one_key_makes_no_container_for_it() -> None:
    """The usual transaction claims one key: it is kept in fields, and a dictionary of held
    keys is made only for a second one (which then commits as the pending record it is)."""
    store = MemoryStore(clock=_Clock())
    first, second = (RecordKey("tenant", "POST /things", k) for k in ("k1", "k2"))
    async with store.transaction(acquire_timeout=1.0) as tx:
        assert isinstance(
            await tx.claim(first, b"fp", retention_seconds=60.0, wait_seconds=1.0), Claimed
        )
        assert tx._earlier is None
        assert tx._claimed == first
        await tx.finish(State.SUCCEEDED, StoredResponse(201, HEADERS, b"{}", None))
        assert first not in store._owners
    assert store._rows[first].state is State.SUCCEEDED
    async with store.transaction(acquire_timeout=1.0) as tx:
        tx.hold(second)
        assert tx._earlier == {second: None}
        other = store.transaction(acquire_timeout=1.0)
        with pytest.raises(ClaimBusy):
            await other.claim(second, b"fp", retention_seconds=60.0, wait_seconds=1.0)
        await tx.abandon()
    assert second not in store._owners
    assert second not in store._rows


async def test_a_key_held_after_a_claim_leaves_that_claim_the_one_completed() -> None:
    """Holding another key (as a test harness does) never moves the transaction's own claim
    aside: `finish` still completes it, and the held key is released uncommitted."""
    store = MemoryStore(clock=_Clock())
    claimed, held = (RecordKey("tenant", "POST /things", k) for k in ("k1", "k2"))
    async with store.transaction(acquire_timeout=1.0) as tx:
        await tx.claim(claimed, b"fp", retention_seconds=60.0, wait_seconds=1.0)
        tx.hold(held)
        await tx.finish(State.SUCCEEDED, StoredResponse(201, HEADERS, b"{}", None))
    assert store._rows[claimed].state is State.SUCCEEDED
    assert held not in store._rows
    assert held not in store._owners
