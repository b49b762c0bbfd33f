"""The in-memory store keeps its committed records in a form the garbage collector stops
tracking, and reads them back unchanged."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from idem_middleware.store.base import RecordKey, State, StoredResponse
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
