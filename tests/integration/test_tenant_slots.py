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


async def test_a_transactional_duplicate_waiting_already_waits_for_a_slot_too(store: Any) -> None:
    """Found by probing: a duplicate whose first claim found the key busy polls by claiming
    again, and a poll that found its tenant's slots all taken (by other requests of the tenant,
    or its fellow duplicates' polls) was answered `429 tenant-busy` at once, seconds before its
    `wait_seconds`: 17 of 20 such duplicates, where lease mode replayed all. It waits for a slot
    within its wait now, and gets the replay."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from tests.apps import one_route_app

    gates = {"original": asyncio.Event(), "other": asyncio.Event()}
    entered: dict[str, asyncio.Event] = {name: asyncio.Event() for name in gates}

    async def pay(request: Request) -> Response:
        which = (await request.json())["which"]
        entered[which].set()
        await gates[which].wait()
        return JSONResponse({"which": which}, 201)

    app = one_route_app(
        "/pay",
        pay,
        store=store,
        default_policy=Policy(wait_seconds=10),
        max_tenant_connections=2,
    )
    async with client(app) as http:
        body = {"which": "original"}
        original = asyncio.ensure_future(http.post("/pay", json=body, headers=key("k")))
        await asyncio.wait_for(entered["original"].wait(), BOUND)
        duplicate = asyncio.ensure_future(http.post("/pay", json=body, headers=key("k")))
        await asyncio.sleep(0.1)  # its first claim found the key busy: it waits, holding no slot
        other = asyncio.ensure_future(
            http.post("/pay", json={"which": "other"}, headers=key("k-other"))
        )
        await asyncio.wait_for(entered["other"].wait(), BOUND)
        await asyncio.sleep(0.5)  # the duplicate's polls find both slots taken
        assert not duplicate.done()
        gates["original"].set()  # its slot comes free: the woken duplicate takes it, replays
        gates["other"].set()
        answers = await asyncio.wait_for(asyncio.gather(original, duplicate, other), BOUND)
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert answers[1].headers["idempotent-replayed"] == "true"
