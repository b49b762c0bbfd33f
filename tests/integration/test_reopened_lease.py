"""A lease-mode record an operator reopened (`reopen`: its outcome back to `unknown`) is settled
by an operator only. Its outcome may have committed the handler's fenced writes with it: the
route's reconciler, asked again on a retry or by `reconcile`, answered `Happened` and wrote its
own (the documented `ask_the_bank` debits in its fenced connection): two debits for one payment.
A record marked `unknown` the ordinary way (its fenced transaction rolled back) is still
reconciled."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy
from idem_middleware.ops import Resolution, reopen, resolve
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from idem_middleware.reconcile_batch import reconcile_unknown
from idem_middleware.status import status_route
from idem_middleware.store.base import RecordKey, State, Store
from tests.apps import assert_problem, client, key, one_route_app

KEY = RecordKey("tenant-a", "POST /pay", "k1")


def pay_app(store: Store, asked: list[int], fails: bool = False) -> Any:
    """`POST /pay` in lease mode, whose reconciler (noted in `asked`) always finds the payment;
    `fails`: the handler raises (its record is then `unknown` the ordinary way)."""

    async def pay(request: Request) -> Response:
        if fails:
            raise RuntimeError("the bank's answer was lost")
        return JSONResponse({"paid": True}, status_code=201)

    policy = Policy(
        mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=0.2, reconciler=asked_reconciler(asked)
    )
    app = one_route_app("/pay", pay, store=store, default_policy=policy)
    app.router.routes.append(status_route(store))
    return app


def asked_reconciler(asked: list[int]) -> Any:
    async def ask_the_bank(context: ReconcileContext) -> Reconciliation:
        asked.append(context.generation)
        return Happened.json(201, {"paid": True, "reconciled": True})

    return ask_the_bank


async def test_a_reopened_lease_record_is_left_to_an_operator(store: Store) -> None:
    asked: list[int] = []
    app = pay_app(store, asked)
    async with client(app) as c:
        first = await c.post("/pay", json={}, headers=key("k1"))
        assert first.status_code == 201
        await reopen(store, KEY, note="the bank disagrees")
        retry = await c.post("/pay", json={}, headers=key("k1"))
        status = await c.get("/idempotency/status", params={"operation": "POST /pay", "key": "k1"})
    report = await reconcile_unknown(store, {"POST /pay": asked_reconciler(asked)})
    assert_problem(retry, 409, "outcome-unknown")
    assert status.json()["retry"] is False
    assert report.by_hand == {"POST /pay": 1}
    assert asked == []
    summary = await store.describe(KEY)
    assert summary is not None
    assert (summary.state, summary.reopened, summary.by_hand) == (State.UNKNOWN, True, True)
    # Resolved by hand, and reopened no more: an operator's move draws a new generation.
    await resolve(store, KEY, Resolution.RETRY, note="it did not happen after all")
    moved = await store.describe(KEY)
    assert moved is not None
    assert (moved.state, moved.reopened) == (State.PENDING, False)


async def test_a_record_marked_unknown_otherwise_is_still_reconciled(store: Store) -> None:
    asked: list[int] = []
    async with client(pay_app(store, asked, fails=True)) as c:
        first = await c.post("/pay", json={}, headers=key("k1"))
        summary = await store.describe(KEY)
        retry = await c.post("/pay", json={}, headers=key("k1"))
    assert first.status_code == 500
    assert summary is not None
    assert (summary.state, summary.reopened, summary.by_hand) == (State.UNKNOWN, False, False)
    assert retry.status_code == 201
    assert retry.json() == {"paid": True, "reconciled": True}
    assert asked == [summary.generation]
