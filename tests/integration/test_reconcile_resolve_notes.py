"""`ops.resolve` and `ops.reopen` (the library's operator moves) refuse an audit note the
database cannot hold before any statement, as the CLI's `--note` does: a NUL was the store's
TextRefused (a StoreError, which a caller takes for the database failing and retries) and a lone
surrogate the driver's own `asyncpg.DataError`, each after the record was read, the record left
as it was."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware.ops import Resolution, operator_response, reopen, resolve
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, Store

KEY = RecordKey("t", "POST /payouts", "k")
NOTES = ["bank said\x00no", "bank said \ud800"]


async def _record(store: Store, state: State) -> int:
    claim = await store.claim_lease(KEY, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    response = operator_response(Resolution.SUCCEEDED, 201) if state is State.SUCCEEDED else None
    assert await store.settle(KEY, claim.generation, State.PENDING, Settlement(state, response))
    return claim.generation


@pytest.mark.parametrize("note", NOTES, ids=["nul", "surrogate"])
@pytest.mark.parametrize("to", list(Resolution))
async def test_resolve_refuses_a_note_the_database_cannot_hold(
    store: Store, note: str, to: Resolution
) -> None:
    generation = await _record(store, State.UNKNOWN)
    response: Any = (
        None
        if to is Resolution.RETRY
        else operator_response(to, 201 if to is Resolution.SUCCEEDED else 402)
    )
    with pytest.raises(ValueError, match="audit note"):
        await resolve(store, KEY, to, note=note, response=response)
    record = await store.get(KEY)
    assert record is not None
    assert (record.state, record.generation) == (State.UNKNOWN, generation)


@pytest.mark.parametrize("note", NOTES, ids=["nul", "surrogate"])
async def test_reopen_refuses_a_note_the_database_cannot_hold(store: Store, note: str) -> None:
    generation = await _record(store, State.SUCCEEDED)
    with pytest.raises(ValueError, match="audit note"):
        await reopen(store, KEY, note=note)
    record = await store.get(KEY)
    assert record is not None
    assert (record.state, record.generation) == (State.SUCCEEDED, generation)


async def test_an_ordinary_note_still_lands(store: Store) -> None:
    await _record(store, State.UNKNOWN)
    await resolve(store, KEY, Resolution.RETRY, note="bank: no such transfer (caf\xe9 \U0001f4b8)")
    summary = await store.describe(KEY)
    assert summary is not None
    assert (summary.note or "").endswith(
        "resolve unknown -> pending: bank: no such transfer (caf\xe9 \U0001f4b8)"
    )
