"""A lease-mode handler (or job) runs helpers under `asyncio.gather`; one raises, and `gather`
raises at once while the other runs on and asks for the fenced connection as the execution
cleans up. Opened after the cleanup's rollback, nothing ever ended that transaction: the
`unknown` mark waited for its row lock for good, the request never answered, and every retry
got `409 request-in-flight`. Once the execution is over no fenced transaction opens: the helper
is refused (`StaleGeneration`), the record is `unknown`, nothing is left open."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import IdempotencyContext, Mode, Policy, PostgresStore, get_context
from idem_middleware.errors import StaleGeneration
from idem_middleware.jobs import idempotent_job
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from idem_middleware.store.base import RecordKey, Settlement, State, Store
from tests.apps import BOUND, client, idle_in_transaction, key, one_route_app


class Helpers:
    """Two helpers of one execution: the first raises at once; the second asks for the fenced
    connection once the execution marks its record `unknown` (the store's mark waits for it to
    have asked), and notes what became of it."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refused: list[StaleGeneration] = []
        self.wrote = 0
        self.marking, self.asked = asyncio.Event(), asyncio.Event()
        real_settle = store.settle

        async def settle(key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
            if s.state is State.UNKNOWN:
                self.marking.set()
                await asyncio.wait_for(self.asked.wait(), BOUND)
            return await real_settle(key, generation, expected, s)

        monkeypatch.setattr(store, "settle", settle)

    async def run(self, context: IdempotencyContext) -> None:
        async def fails() -> None:
            raise RuntimeError("the first helper fails")

        async def writes() -> None:
            await asyncio.wait_for(self.marking.wait(), BOUND)
            try:
                conn = await context.fenced_connection()
                if conn is not None:  # (the in-memory store's fence has no connection)
                    await conn.execute("SELECT 1")
                self.wrote += 1
            except StaleGeneration as exc:
                self.refused.append(exc)
            finally:
                self.asked.set()

        await asyncio.gather(fails(), writes())


async def nothing_left_open(store: Store, helpers: Helpers) -> None:
    if isinstance(store, PostgresStore):
        assert await idle_in_transaction(store.pool) == 0
    assert helpers.wrote == 0
    assert len(helpers.refused) == 1


async def test_a_helper_running_on_after_its_handler_raised_opens_no_fence(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    helpers = Helpers(store, monkeypatch)

    async def pay(request: Request) -> Response:
        await helpers.run(get_context(request))
        return JSONResponse({}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=0.2)
    app = one_route_app("/pay", pay, store=store, default_policy=policy)
    async with client(app) as c:
        first = await asyncio.wait_for(c.post("/pay", json={}, headers=key("k1")), BOUND)
        await nothing_left_open(store, helpers)
        retry = await asyncio.wait_for(c.post("/pay", json={}, headers=key("k1")), BOUND)
    assert first.status_code == 500
    assert retry.status_code == 409
    assert retry.json()["type"].endswith("outcome-unknown")
    record = await store.get(RecordKey("tenant-a", "POST /pay", "k1"))
    assert record is not None
    assert record.state is State.UNKNOWN


async def test_a_lease_jobs_helper_running_on_after_it_raised_opens_no_fence(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    helpers = Helpers(store, monkeypatch)

    @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=30.0)
    async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, Any]:
        await helpers.run(job)
        return {}

    with pytest.raises(RuntimeError, match="the first helper fails"):
        await asyncio.wait_for(payout(ref="p1"), BOUND)
    await nothing_left_open(store, helpers)
    record = await store.get(RecordKey("", "payout", "p1"))
    assert record is not None
    assert record.state is State.UNKNOWN


async def test_a_reconcilers_helper_running_on_after_it_raised_opens_no_fence(store: Store) -> None:
    """The same for a reconciler asked on a retry: its helper, asking for the fenced connection
    once the retry was answered, opened a transaction nobody ended (every later retry 409, an
    operator's `resolve` refused as held)."""
    answered = asyncio.Event()
    refused: list[StaleGeneration] = []
    helpers: list[asyncio.Task[None]] = []

    async def pay(request: Request) -> Response:
        raise RuntimeError("the bank's answer was lost")

    async def ask_the_bank(context: ReconcileContext) -> Reconciliation:
        if helpers:  # (asked again: it happened)
            return Happened.json(201, {"paid": True})

        async def helper() -> None:
            await asyncio.wait_for(answered.wait(), BOUND)
            try:
                await context.fenced_connection()
            except StaleGeneration as exc:
                refused.append(exc)

        helpers.append(asyncio.ensure_future(helper()))
        raise RuntimeError("the first helper fails")

    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=0.2, reconciler=ask_the_bank)
    app = one_route_app("/pay", pay, store=store, default_policy=policy)
    async with client(app) as c:
        first = await c.post("/pay", json={}, headers=key("k1"))
        asked = await c.post("/pay", json={}, headers=key("k1"))
        answered.set()
        await asyncio.wait_for(helpers[0], BOUND)
        if isinstance(store, PostgresStore):
            assert await idle_in_transaction(store.pool) == 0
        again = await asyncio.wait_for(c.post("/pay", json={}, headers=key("k1")), BOUND)
    assert (first.status_code, asked.status_code, again.status_code) == (500, 409, 201)
    assert len(refused) == 1
