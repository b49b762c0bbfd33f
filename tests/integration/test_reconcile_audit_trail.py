"""A reconciler's "not happened" is in the record's audit trail whoever asked it: a client's
retry (which takes the record over and runs the request again) as much as `reconcile`'s batch
(which releases it for that retry). Only the batch's left a line: a record asked by a retry
went from `unknown` to a second run with nothing in its trail to say why the handler ran twice."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from idem_middleware import Mode, idempotent
from idem_middleware.ops import reconcile_unknown
from idem_middleware.reconcile import NotHappened, ReconcileContext, Reconciliation
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, State, Store
from tests.apps import client, one_route_app

HEADERS = {"idempotency-key": "k"}
KEY = RecordKey("tenant-a", "POST /payouts", "k")


def _lost_then_paid(store: Store, reconciler: Any) -> tuple[Any, list[int]]:
    """`POST /payouts`: its first run's answer is lost (502: unknown), later ones pay (201)."""
    runs: list[int] = []

    async def payout(request: Request) -> JSONResponse:
        await request.body()
        runs.append(1)
        return JSONResponse({"run": len(runs)}, status_code=502 if len(runs) == 1 else 201)

    handler = idempotent(mode=Mode.LEASE, reconciler=reconciler)(payout)
    return one_route_app("/payouts", handler, store=store), runs


async def _not_happened(ctx: ReconcileContext) -> Reconciliation:
    return NotHappened()


def _trail(note: str | None) -> list[str]:
    """The trail's lines without their time stamps."""
    return [line.split(" ", 1)[1] for line in (note or "").splitlines()]


async def test_a_retrys_not_happened_is_in_the_audit_trail(store: Store) -> None:
    app, runs = _lost_then_paid(store, _not_happened)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        retry = await c.post("/payouts", headers=HEADERS, json={})
    assert (retry.status_code, retry.json(), len(runs)) == (201, {"run": 2}, 2)
    summary = await store.describe(KEY)
    assert summary is not None
    assert summary.state is State.SUCCEEDED
    assert _trail(summary.note) == ["reconciled unknown -> pending: not happened"]


async def test_the_batchs_not_happened_leaves_the_same_single_line(store: Store) -> None:
    """The batch's release, then the client's retry taking the released record over: one line,
    not two (the takeover of a released record is no reconciliation)."""
    app, runs = _lost_then_paid(store, _not_happened)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        report = await reconcile_unknown(store, {KEY.operation: _not_happened})
        assert report.verdicts == {"not-happened": 1}
        retry = await c.post("/payouts", headers=HEADERS, json={})
    assert (retry.status_code, len(runs)) == (201, 2)
    summary = await store.describe(KEY)
    assert summary is not None
    assert summary.state is State.SUCCEEDED
    assert _trail(summary.note) == ["reconciled unknown -> pending: not happened"]


async def test_a_lapsed_lease_taken_over_adds_no_line(store: Store) -> None:
    """Only a takeover of an `unknown` record is a reconciler's verdict: a takeover of a pending
    one (its lease lapsed, `LeaseExpiry.TAKEOVER`) is not, and leaves the trail as it was."""
    claim = await store.claim_lease(KEY, b"f", retention_seconds=60, lease_seconds=0.01)
    assert isinstance(claim, Claimed)
    await asyncio.sleep(0.05)
    generation = await store.takeover(KEY, claim.generation, State.PENDING, 30)
    assert generation is not None
    summary = await store.describe(KEY)
    assert summary is not None
    assert summary.note is None
