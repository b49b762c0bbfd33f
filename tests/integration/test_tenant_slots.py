"""A tenant's cap (`max_tenant_connections`) covers every stretch in which its requests may hold
a store connection, and nothing else (found by probing):

- in lease mode, a duplicate that ends up running the handler (the key was released, taken
  over, or reconciled as not happened) holds a slot like any execution;
- a retry that runs the route's reconciler (which may open its fenced transaction) holds one;
- a response that streams after its outcome is committed holds no connection, and gives its
  slot back as it starts, in both modes: a client that never reads does not lock its tenant out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import Mode, Policy, PostgresStore
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from tests.apps import (
    BOUND,
    NeverReads,
    Step,
    asgi_request,
    assert_problem,
    build_app,
    build_lease_app,
    client,
    key,
    reset_downstream,
    until,
)

PAYOUT = {"account": "acc-1", "amount": 5}


@pytest.fixture
async def bank(pool: asyncpg.Pool[Any]) -> asyncpg.Pool[Any]:
    await reset_downstream(pool)
    return pool


async def test_a_lease_duplicate_that_runs_the_handler_holds_its_tenants_slot(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    policy = Policy(mode=Mode.LEASE, lease_seconds=5.0, wait_seconds=5.0)
    app = build_lease_app(pg_store, bank, policy, max_tenant_connections=2)
    probe = app.state.probe
    gates = [asyncio.Event() for _ in range(3)]
    # The original answers 409 (its key is released for the client's retry), and the waiting
    # duplicate then claims and runs; a request of another key runs beside it.
    probe.steps = [Step(status=409, gate=gates[0]), Step(gate=gates[1]), Step(gate=gates[2])]
    async with client(app) as http:
        original = asyncio.ensure_future(http.post("/payouts", json=PAYOUT, headers=key("k1")))
        await until(lambda: probe.calls == 1)
        duplicate = asyncio.ensure_future(http.post("/payouts", json=PAYOUT, headers=key("k1")))
        await asyncio.sleep(0.2)  # the duplicate waits, holding no slot
        gates[0].set()
        assert (await asyncio.wait_for(original, BOUND)).status_code == 409
        await until(lambda: probe.calls == 2)  # the duplicate runs the handler now
        beside = asyncio.ensure_future(http.post("/payouts", json=PAYOUT, headers=key("k2")))
        await until(lambda: probe.calls == 3)
        # Two of the tenant's requests run: the duplicate holds the second slot.
        busy = await asyncio.wait_for(http.post("/payouts", json=PAYOUT, headers=key("k3")), BOUND)
        assert_problem(busy, 429, "tenant-busy")
        gates[1].set()
        gates[2].set()
        assert (await asyncio.wait_for(duplicate, BOUND)).status_code == 201
        assert (await asyncio.wait_for(beside, BOUND)).status_code == 201
    assert probe.calls == 3


@pytest.fixture
async def spawned() -> AsyncIterator[list[asyncio.Future[Any]]]:
    tasks: list[asyncio.Future[Any]] = []
    yield tasks
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _stuck_streams(
    app: Any, path: str, body: bytes, count: int, spawned: list[asyncio.Future[Any]]
) -> None:
    for i in range(count):
        reader = NeverReads(body)
        scope = asgi_request(path, f"stuck-{i}", len(body))
        spawned.append(asyncio.ensure_future(app(scope, reader.receive, reader.send)))
        await asyncio.wait_for(reader.started.wait(), BOUND)


async def test_a_transactional_stream_gives_its_slot_back_as_it_starts(
    pg_store: PostgresStore, spawned: list[asyncio.Future[Any]]
) -> None:
    app = build_app(pg_store, max_tenant_connections=2)
    await _stuck_streams(app, "/stream", b"{}", 2, spawned)
    async with client(app) as http:
        reply = await asyncio.wait_for(
            http.post("/items", json={"amount": 5}, headers=key("k")), BOUND
        )
    assert reply.status_code == 201, reply.text
    assert not any(task.done() for task in spawned), "the streams must still be stuck"


async def test_a_lease_stream_gives_its_slot_back_as_it_starts(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], spawned: list[asyncio.Future[Any]]
) -> None:
    policy = Policy(mode=Mode.LEASE, lease_seconds=5.0)
    app = build_lease_app(pg_store, bank, policy, max_tenant_connections=1)
    app.state.probe.steps = [Step(stream=True)]
    body = b'{"account": "acc-1", "amount": 5}'
    await _stuck_streams(app, "/payouts", body, 1, spawned)
    async with client(app) as http:
        reply = await asyncio.wait_for(http.post("/payouts", json=PAYOUT, headers=key("k")), BOUND)
    assert reply.status_code == 201, reply.text
    assert not any(task.done() for task in spawned)


async def test_a_reconciler_a_retry_runs_holds_its_tenants_slot(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """A retry of an unknown record runs the route's reconciler, which may open its fenced
    transaction (a pooled connection, held while it asks the bank): it holds a slot of its
    tenant's meanwhile, as an execution does. It took none, so a tenant's retries of many
    unknown keys could hold as many connections as they liked, past the cap, and take the
    pool from every other tenant."""
    gate = asyncio.Event()
    asking: list[str] = []

    async def ask_the_bank(rc: ReconcileContext) -> Reconciliation:
        await rc.fenced_connection()
        asking.append(rc.key)
        await gate.wait()
        return Happened.json(201, {"reconciled": True})

    policy = Policy(mode=Mode.LEASE, lease_seconds=5.0, wait_seconds=0.3, reconciler=ask_the_bank)
    app = build_lease_app(pg_store, bank, policy, max_tenant_connections=1)
    app.state.probe.steps = [Step(fail="after"), Step(fail="after")]
    async with client(app) as http:
        for k in ("k1", "k2"):  # two unknown records of the tenant's
            failed = await http.post("/payouts", json=PAYOUT, headers=key(k))
            assert failed.status_code == 500
        first = asyncio.ensure_future(http.post("/payouts", json=PAYOUT, headers=key("k1")))
        try:
            await until(lambda: asking == ["k1"])
            second = await asyncio.wait_for(
                http.post("/payouts", json=PAYOUT, headers=key("k2")), BOUND
            )
        finally:
            gate.set()
        assert_problem(second, 429, "tenant-busy")
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
        assert asking == ["k1"]
        again = await http.post("/payouts", json=PAYOUT, headers=key("k2"))
    assert again.status_code == 201, again.text
    assert asking == ["k1", "k2"]
