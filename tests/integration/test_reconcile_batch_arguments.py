"""`reconcile_unknown`'s `takeover`, `known` and `report`, checked before any statement: one
operation name given as a str was read as its substrings (`"POST /pay"` is in
`"POST /payouts"`), so the lapsed lease of an operation never named was left pending and counted
nowhere; a `report` of another type failed after the first lapsed lease had been moved."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware.ops import ReconcileReport, reconcile_unknown
from idem_middleware.reconcile import NotHappened, ReconcileContext, Reconciliation
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, State, Store

LAPSED = RecordKey("t", "POST /pay", "k")


async def _not_happened(ctx: ReconcileContext) -> Reconciliation:
    return NotHappened()


async def _lapsed(store: Store) -> int:
    claim = await store.claim_lease(LAPSED, b"f", retention_seconds=60, lease_seconds=0.01)
    assert isinstance(claim, Claimed)
    await asyncio.sleep(0.05)
    return claim.generation


@pytest.mark.parametrize(
    "arguments",
    [
        {"takeover": "POST /payouts"},
        {"known": "POST /payouts POST /pay"},
        {"takeover": b"POST /payouts"},
        {"known": 5},
        {"takeover": (name for name in ["POST /payouts"])},
        {"report": {}},
    ],
    ids=["takeover-str", "known-str", "takeover-bytes", "known-int", "generator", "report"],
)
async def test_nonsense_is_refused_before_any_move(store: Store, arguments: dict[str, Any]) -> None:
    generation = await _lapsed(store)
    with pytest.raises(TypeError, match=r"^(takeover|known|report) "):
        await reconcile_unknown(store, {"POST /payouts": _not_happened}, **arguments)
    record = await store.get(LAPSED)
    assert record is not None
    assert (record.state, record.generation) == (State.PENDING, generation)


@pytest.mark.parametrize(
    "known",
    [None, ["POST /pay"], {"POST /pay": 1}.keys(), frozenset({"POST /pay"})],
    ids=["none", "list", "keys", "frozenset"],
)
async def test_collections_of_names_still_work(store: Store, known: Any) -> None:
    """The lapsed lease of an operation not in `takeover` is turned unknown."""
    await _lapsed(store)
    report = ReconcileReport()
    returned = await reconcile_unknown(
        store, {}, takeover=["POST /payouts"], known=known, report=report
    )
    assert returned is report
    assert report.expired_leases == 1
    record = await store.get(LAPSED)
    assert record is not None
    assert record.state is State.UNKNOWN
