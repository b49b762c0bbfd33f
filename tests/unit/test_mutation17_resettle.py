"""resettle.py, pinned against hand-made mutants (mutation17):

- a settlement sent again (`send_again`) or read back (`landed`) counts the record as its own
  only under its own generation: a later execution that took the record over and recorded the
  same outcome is not this settlement (its handler's writes may have been rolled back);
- `same_response` tells a response whose body was omitted from one stored with it empty;
- a response its client cut short whose settlement the database refused leaves the record
  `unknown`, not `pending`: left pending, it is taken over once its lease lapses and the
  handler, which ran, runs again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware.errors import StatementRefused, StoreError
from idem_middleware.resettle import cut_short, landed, same_response, send_again
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, StoredResponse
from idem_middleware.store.memory import MemoryStore

KEY = RecordKey("t", "POST /pay", "k")
DOWN = StoreError("ConnectionRefusedError: the server is down")
RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id": 7}')


async def test_a_later_generation_with_the_same_outcome_is_not_this_settlement() -> None:
    store = MemoryStore()
    first = await store.claim_lease(KEY, b"f" * 32, retention_seconds=60, lease_seconds=0.01)
    assert isinstance(first, Claimed)
    await asyncio.sleep(0.05)  # its lease lapsed: taken over
    second = await store.takeover(KEY, first.generation, State.PENDING, lease_seconds=30)
    assert second is not None
    assert second != first.generation
    assert await store.settle(KEY, second, State.PENDING, Settlement(State.SUCCEEDED, RESPONSE))
    ours = Settlement(State.SUCCEEDED, RESPONSE)
    assert not await send_again(store, KEY, first.generation, ours, seconds=5.0, error=DOWN)
    assert not await landed(store, KEY, first.generation, State.SUCCEEDED, RESPONSE)
    assert await landed(store, KEY, second, State.SUCCEEDED, RESPONSE)


def test_a_body_omitted_is_not_an_empty_body() -> None:
    empty = StoredResponse(200, [], b"")
    omitted = StoredResponse(200, [], b"", "streaming")
    assert not same_response(empty, omitted)
    assert not same_response(omitted, empty)
    assert same_response(omitted, StoredResponse(200, [], b"", "streaming"))


class _Execution:
    """What `cut_short` asks of a lease execution."""

    def __init__(self) -> None:
        self.unresolved = 0
        self.fence = None

    async def _settle(self, *args: Any, **kwargs: Any) -> bool:
        raise StatementRefused("value too long for type character varying")

    async def _unresolved(self, context: Any, **kwargs: Any) -> None:
        self.unresolved += 1


async def test_a_cut_short_response_whose_settlement_was_refused_is_marked_unknown() -> None:
    execution = _Execution()
    with pytest.raises(StatementRefused):
        await cut_short(execution, object(), object(), object())  # type: ignore[arg-type]
    assert execution.unresolved == 1
