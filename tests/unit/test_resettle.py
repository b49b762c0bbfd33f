"""Sending a failed lease-mode settlement again (resettle.py), on a faulty in-memory store."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest

from idem_middleware.context import claimed_context
from idem_middleware.errors import StatementRefused, StoreError
from idem_middleware.policy import Mode
from idem_middleware.resettle import landed, send_again, unresolve_after
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, StoredResponse
from idem_middleware.store.memory import MemoryStore

KEY = RecordKey("t", "POST /pay", "k")
DONE = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
DOWN = StoreError("ConnectionRefusedError: the server is down")


class Flaky(MemoryStore):
    """Its first `failures` settlements (and releases) fail with `error`, after committing if
    `committed`; reads fail while settlements do."""

    def __init__(self, failures: int, error: StoreError = DOWN, committed: bool = False) -> None:
        super().__init__()
        self.failures = failures
        self.error = error
        self.committed = committed
        self.tries = 0

    async def _fault(self) -> None:
        self.tries += 1
        if self.tries <= self.failures:
            raise self.error

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if self.committed and self.tries < self.failures:
            await super().settle(key, generation, expected, s)
        await self._fault()
        return await super().settle(key, generation, expected, s)

    async def release(self, key: RecordKey, generation: int) -> bool:
        if self.committed and self.tries < self.failures:
            await super().release(key, generation)
        await self._fault()
        return await super().release(key, generation)


async def claimed(store: MemoryStore) -> int:
    claim = await store.claim_lease(KEY, b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    return claim.generation


async def test_sent_until_the_store_answers() -> None:
    store = Flaky(failures=3)
    generation = await claimed(store)
    assert await send_again(store, KEY, generation, DONE, seconds=5.0, error=DOWN)
    assert store.tries == 4
    record = await store.get(KEY)
    assert record is not None
    assert record.state is State.SUCCEEDED


@pytest.mark.parametrize("settlement", [DONE, None], ids=["settle", "release"])
async def test_an_attempt_that_committed_before_its_answer_was_lost_counts(
    settlement: Settlement | None,
) -> None:
    store = Flaky(failures=1, committed=True)
    generation = await claimed(store)
    assert await send_again(store, KEY, generation, settlement, seconds=5.0, error=DOWN)


async def test_a_record_taken_over_meanwhile_is_not_this_settlement() -> None:
    """Taken over (another generation holds the record): the settlement is refused, and the
    record is not this settlement's."""
    store = MemoryStore()
    generation = await claimed(store)
    assert not await send_again(store, KEY, generation + 1, DONE, seconds=5.0, error=DOWN)


async def test_a_final_outcome_is_recorded_over_an_unknown_mark_of_its_generation() -> None:
    """Marked `unknown` under this generation (a duplicate found its lease lapsed; nobody took
    the record over): the outcome sent again is still the one to record, as `Fence.settle`
    records it. A release is not (its record stays `unknown`), nor the outcome of a handler
    that asked for its fenced transaction (`over_unknown` False: its fenced writes never
    happened)."""
    store = MemoryStore()
    generation = await claimed(store)
    assert await store.settle(KEY, generation, State.PENDING, Settlement(State.UNKNOWN))
    again = partial(send_again, store, KEY, generation, seconds=5.0, error=DOWN)
    assert not await again(None, over_unknown=True)
    assert not await again(DONE, over_unknown=False)
    assert not await landed(store, KEY, generation, State.SUCCEEDED, DONE.response)
    assert await again(DONE, over_unknown=True)
    assert await landed(store, KEY, generation, State.SUCCEEDED, DONE.response)


async def test_a_reconcilers_outcome_under_this_generation_is_not_this_settlement() -> None:
    """Found by attacking lease mode: the executor's settlement kept failing (its process cut
    off from the database past its lease), a retry's reconciler settled the record `unknown` ->
    succeeded under the same generation with its own response, and the resend took that for its
    own commit: its client got the handler's response, every replay the reconciler's."""
    store = MemoryStore()
    generation = await claimed(store)
    reconciled = StoredResponse(201, [(b"content-type", b"application/json")], b'{"r": 1}')
    assert await store.settle(KEY, generation, State.PENDING, Settlement(State.UNKNOWN))
    happened = Settlement(State.SUCCEEDED, reconciled)
    assert await store.settle(KEY, generation, State.UNKNOWN, happened)
    assert not await send_again(store, KEY, generation, DONE, seconds=5.0, error=DOWN)
    assert not await landed(store, KEY, generation, State.SUCCEEDED, DONE.response)
    # The same response, held in another kind of sequence, is that settlement's.
    same = Settlement(State.SUCCEEDED, StoredResponse(201, (reconciled.headers[0],), b'{"r": 1}'))
    assert await send_again(store, KEY, generation, same, seconds=5.0, error=DOWN)
    assert await landed(store, KEY, generation, State.SUCCEEDED, same.response)


async def test_bounded_and_the_last_error_stands() -> None:
    store = Flaky(failures=1_000)
    generation = await claimed(store)
    with pytest.raises(StoreError) as raised:
        await send_again(store, KEY, generation, DONE, seconds=0.0, error=DOWN)
    assert store.tries == 2  # at least twice, however little time is left
    assert raised.value is DOWN


async def test_a_statement_the_database_refused_is_not_sent_again() -> None:
    refused = StatementRefused("RaiseError: a trigger said no")
    store = Flaky(failures=1, error=refused)
    generation = await claimed(store)
    with pytest.raises(StatementRefused):
        await send_again(store, KEY, generation, DONE, seconds=5.0, error=DOWN)
    assert store.tries == 1


@pytest.mark.parametrize(
    "error", [asyncio.CancelledError(), RuntimeError("the handler's")], ids=["cancelled", "raised"]
)
async def test_a_cancellation_goes_on_when_its_unknown_mark_fails(error: BaseException) -> None:
    """A StoreError took a cancellation's place: the cancelled task ended as if it had not been
    (a request answered 503). Now the cancellation goes on; an exception's mark that fails
    still raises the store's error (its client gets a 503, documented)."""
    store = Flaky(failures=1_000)
    generation = await claimed(store)
    context = claimed_context(*KEY, generation, Mode.LEASE, None, None)
    expected = type(error) if isinstance(error, asyncio.CancelledError) else StoreError
    with pytest.raises(expected):
        await unresolve_after(error, store, KEY, generation, context, seconds=0.0)
    assert store.tries == 1
