"""A settlement sent again (resettle.py `send_again`, `landed`) counts a record as its own only
if the response stored is the one it sent, headers included (`same_response`): a
reconciler that settled the same generation meanwhile with the same status and body and other
headers stored its own response, and the client must not be told the handler's."""

from __future__ import annotations

from idem_middleware.errors import StoreError
from idem_middleware.resettle import landed, send_again
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, StoredResponse
from idem_middleware.store.memory import MemoryStore

KEY = RecordKey("t", "POST /pay", "k")
DOWN = StoreError("ConnectionRefusedError: the server is down")


async def test_a_reconcilers_response_with_other_headers_is_not_this_settlement() -> None:
    store = MemoryStore()
    claim = await store.claim_lease(KEY, b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    generation = claim.generation
    assert await store.settle(KEY, generation, State.PENDING, Settlement(State.UNKNOWN))
    reconciled = StoredResponse(201, [(b"location", b"/payments/from-the-bank")], b"{}")
    assert await store.settle(
        KEY, generation, State.UNKNOWN, Settlement(State.SUCCEEDED, reconciled)
    )
    ours = Settlement(State.SUCCEEDED, StoredResponse(201, [(b"location", b"/payments/7")], b"{}"))
    assert not await send_again(store, KEY, generation, ours, seconds=5.0, error=DOWN)
    assert not await landed(store, KEY, generation, State.SUCCEEDED, ours.response)


async def test_a_reconcilers_response_with_another_body_is_not_this_settlement() -> None:
    """`same_response` compares the bodies too: the reconciler's `{"id": "bank-1"}` is
    not the handler's `{"id": 7}`, whatever their status and headers."""
    store = MemoryStore()
    claim = await store.claim_lease(KEY, b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    generation = claim.generation
    headers = [(b"content-type", b"application/json")]
    assert await store.settle(KEY, generation, State.PENDING, Settlement(State.UNKNOWN))
    reconciled = StoredResponse(201, headers, b'{"id": "bank-1"}')
    assert await store.settle(
        KEY, generation, State.UNKNOWN, Settlement(State.SUCCEEDED, reconciled)
    )
    ours = Settlement(State.SUCCEEDED, StoredResponse(201, list(headers), b'{"id": 7}'))
    assert not await send_again(store, KEY, generation, ours, seconds=5.0, error=DOWN)
    assert not await landed(store, KEY, generation, State.SUCCEEDED, ours.response)
