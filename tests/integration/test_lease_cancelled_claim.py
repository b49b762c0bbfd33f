"""A lease-mode request cancelled (a shutdown, a timeout around the app) while its claim's
statement is in flight: the claim commits on its own, and the record stayed `pending` under a
live lease (every retry 409), then `unknown` for good, for a handler that never ran. The claim
now runs to its end, and one that lands for a request gone is released: the retry runs it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from idem_middleware import IdempotencyContext, LeaseExpiry, Policy, PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.jobs import idempotent_job
from idem_middleware.policy import Mode
from idem_middleware.store.base import Claimed, RecordKey, State
from idem_middleware.store.postgres.convert import _Q
from tests.apps import one_route_app
from tests.apps.clients import asgi_request, client
from tests.integration.test_lease_cancelled_settlement import BOUND, counted_charge, server

KEY = RecordKey("tenant-a", "POST /charges", "k1")


class HeldAfterClaim(PostgresStore):
    """The first statement of the store's own, once committed, holds its caller (as a reply
    on its way back would) until `gate` is set."""

    entered: asyncio.Event
    gate: asyncio.Event
    armed = False

    def _internal(self) -> Any:
        inner = super()._internal()
        if not self.armed:
            return inner
        self.armed = False

        @contextlib.asynccontextmanager
        async def held() -> AsyncIterator[Any]:
            async with inner as conn:
                yield conn
            self.entered.set()
            await self.gate.wait()

        return held()


def undo_blips_once(store: PostgresStore, query: str | None = None) -> list[str]:
    """The store's first undoing of a landed claim (its release; with `query`, that statement
    of its own) meets a lost connection: sent once, the record stayed `pending` under the
    lease, for a handler that never ran. Returns the tries."""
    executions = store._executions
    tries: list[str] = []
    if query is None:
        release = executions._release

        async def once(key: RecordKey, generation: int) -> bool:
            tries.append("release")
            if len(tries) == 1:
                raise StoreError("ConnectionDoesNotExistError: connection was closed")
            return await release(key, generation)

        executions._release = once
        return tries
    run = executions._run

    async def run_once(method: str, sent: str, *args: Any) -> Any:
        if sent == query:
            tries.append("unclaim")
            if len(tries) == 1:
                raise StoreError("ConnectionDoesNotExistError: connection was closed")
        return await run(method, sent, *args)

    executions._run = run_once
    return tries


@pytest.mark.parametrize("blip", [False, True], ids=["released", "released-after-a-blip"])
@pytest.mark.parametrize("lease", [0.5, 30.0])
async def test_a_claim_cancelled_in_flight_is_released(
    db_dsn: str, lease: float, blip: bool
) -> None:
    runs: list[int] = []

    store = HeldAfterClaim(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.entered, store.gate = asyncio.Event(), asyncio.Event()
    tries = undo_blips_once(store) if blip else []
    policy = Policy(mode=Mode.LEASE, lease_seconds=lease, wait_seconds=0.1)
    async with store:
        await store.pool.execute("DELETE FROM idem_requests WHERE idem_key = 'k1'")
        app = one_route_app(
            "/charges", counted_charge(runs), store=store, policies={"POST /charges": policy}
        )
        async with client(app) as http:  # (the startup check, before the store is armed)
            await http.post("/charges", json={}, headers={"Idempotency-Key": "warm"})
        runs.clear()
        store.armed = True
        receive, send, sent = server()
        request = asyncio.create_task(app(asgi_request("/charges", "k1", 2), receive, send))
        await asyncio.wait_for(store.entered.wait(), BOUND)
        assert await store.get(KEY) is not None  # claimed: committed, its reply held
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(request, BOUND)
        assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [503]
        store.gate.set()  # the claim's reply arrives for a request gone
        for _ in range(int(BOUND / 0.01)):
            if await store.get(KEY) is None:
                break
            await asyncio.sleep(0.01)
        assert await store.get(KEY) is None  # released: nothing ran
        async with client(app) as http:
            retry = await http.post("/charges", json={}, headers={"Idempotency-Key": "k1"})
        assert retry.status_code == 201  # runs now, at once (not 409 for the lease, or for good)
        assert runs == [1]
        assert tries == (["release", "release"] if blip else [])


class HeldAfterTakeover(PostgresStore):
    """A takeover, once committed, holds its caller (its reply on the way back) until `gate`."""

    entered: asyncio.Event
    gate: asyncio.Event

    async def _run_nowait(self, method: str, query: str, *args: Any) -> Any:
        done = await super()._run_nowait(method, query, *args)
        if query == _Q["takeover"]:
            self.entered.set()
            await self.gate.wait()
        return done


@pytest.mark.parametrize("blip", [False, True], ids=["left", "left-after-a-blip"])
async def test_a_takeover_cancelled_in_flight_is_left_to_the_next_retry(
    db_dsn: str, blip: bool
) -> None:
    """A retry takes a lapsed lease over (`LeaseExpiry.TAKEOVER`) and is cancelled with the
    takeover's reply in flight: the record was left `pending` under the taker's live lease,
    nobody running it (every retry 409 for the lease; on a route without TAKEOVER, `unknown`
    for good once it lapsed). It is left to the next retry now, as one released for it: the
    same epoch (the downstream key) and fingerprint, taken over and run at once."""
    runs: list[int] = []

    store = HeldAfterTakeover(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.entered, store.gate = asyncio.Event(), asyncio.Event()
    tries = undo_blips_once(store, _Q["unclaim"]) if blip else []
    policy = Policy(
        mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=0.1, on_lease_expiry=LeaseExpiry.TAKEOVER
    )
    async with store:
        await store.pool.execute("DELETE FROM idem_requests WHERE idem_key = 'k1'")
        app = one_route_app(
            "/charges", counted_charge(runs), store=store, policies={"POST /charges": policy}
        )
        async with client(app) as http:  # (the startup check)
            await http.post("/charges", json={}, headers={"Idempotency-Key": "warm"})
        runs.clear()
        # A first execution whose process died: its claim's lease lapsed, the handler never ran.
        # (The warm-up's body and route are this request's: so is its fingerprint.)
        warm = "SELECT fingerprint FROM idem_requests WHERE idem_key = 'warm'"
        fingerprint = bytes(await store.pool.fetchval(warm))
        first = await store.claim_lease(KEY, fingerprint, retention_seconds=60, lease_seconds=0.1)
        assert isinstance(first, Claimed)
        await asyncio.sleep(0.2)
        receive, send, sent = server()
        request = asyncio.create_task(app(asgi_request("/charges", "k1", 2), receive, send))
        await asyncio.wait_for(store.entered.wait(), BOUND)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(request, BOUND)
        assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [503]
        store.gate.set()
        for _ in range(int(BOUND / 0.01)):
            row = await store.pool.fetchrow(
                "SELECT state, lease_expires_at, epoch, fingerprint FROM idem_requests"
                " WHERE idem_key = 'k1'"
            )
            if row["lease_expires_at"] is None:
                break
            await asyncio.sleep(0.01)
        assert row["state"] == "pending"
        assert row["lease_expires_at"] is None  # released for the next retry
        assert row["epoch"] == first.epoch
        assert bytes(row["fingerprint"]) == fingerprint
        async with client(app) as http:
            retry = await http.post("/charges", json={}, headers={"Idempotency-Key": "k1"})
        assert retry.status_code == 201  # at once, not 409 for the taker's lease
        assert runs == [1]
        assert tries == (["unclaim", "unclaim"] if blip else [])


async def test_a_close_right_after_the_cancellations_waits_for_their_claims(db_dsn: str) -> None:
    """`task.cancel()`, then the store's close in the same turn of the loop: the close found
    no claim in flight yet, closed the pool, and the claim that landed could not be released."""
    store = HeldAfterClaim(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.entered, store.gate = asyncio.Event(), asyncio.Event()
    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=0.1)

    runs: list[int] = []
    await store.open()
    try:
        await store.pool.execute("DELETE FROM idem_requests WHERE idem_key = 'k1'")
        app = one_route_app(
            "/charges", counted_charge(runs), store=store, policies={"POST /charges": policy}
        )
        async with client(app) as http:
            await http.post("/charges", json={}, headers={"Idempotency-Key": "warm"})
        store.armed = True
        receive, send, _sent = server()
        request = asyncio.create_task(app(asgi_request("/charges", "k1", 2), receive, send))
        await asyncio.wait_for(store.entered.wait(), BOUND)
        asyncio.get_running_loop().call_later(0.1, store.gate.set)
    finally:
        request.cancel()
        await store.close()  # (no await between the cancellation and the close)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(request, BOUND)
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as reader:
        assert await reader.get(KEY) is None  # released before the pool closed


async def consumer_cancelled(consumer: asyncio.Task[Any], db_dsn: str) -> Any:
    """The cancelled consumer ends cancelled; its job's record "r1", as another store reads it
    after the close."""
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(consumer, BOUND)
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as reader:
        return await reader.get(RecordKey("", "payout", "r1"))


async def test_a_close_right_after_a_consumers_cancellation_waits_for_its_jobs_claim(
    db_dsn: str,
) -> None:
    """A queue consumer runs its job under `asyncio.wait_for` (a task between it and the
    claim), and shuts down with `consumer.cancel(); await store.close()`: the close waits for
    the claim in flight, however many turns of the loop the cancellation takes to reach it."""
    store = HeldAfterClaim(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.entered, store.gate = asyncio.Event(), asyncio.Event()
    runs: list[str] = []
    await store.open()
    await store.pool.execute("DELETE FROM idem_requests WHERE operation = 'payout'")

    @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=30)
    async def payout(job: IdempotencyContext, *, ref: str) -> None:
        runs.append(ref)

    store.armed = True
    consumer = asyncio.create_task(asyncio.wait_for(payout(ref="r1"), BOUND))
    try:
        await asyncio.wait_for(store.entered.wait(), BOUND)
        asyncio.get_running_loop().call_later(0.1, store.gate.set)
    finally:
        consumer.cancel()
        await store.close()  # (no await between the cancellation and the close)
    record = await consumer_cancelled(consumer, db_dsn)
    assert record is None  # released
    assert runs == []


async def test_a_close_right_after_a_consumers_cancellation_waits_for_its_jobs_mark(
    db_dsn: str,
) -> None:
    """The job is running (its claim landed long ago), under `asyncio.wait_for`: the consumer's
    cancellation reaches it a turn of the loop after `close` began, which found no execution
    cancelled yet and closed the pool; the job's `unknown` mark then met a closed store, and
    the record stayed `pending` under its live lease. The close looks again now."""
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    entered = asyncio.Event()
    await store.open()
    await store.pool.execute("DELETE FROM idem_requests WHERE operation = 'payout'")

    @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=30)
    async def payout(job: IdempotencyContext, *, ref: str) -> None:
        entered.set()
        await asyncio.sleep(BOUND)

    consumer = asyncio.create_task(asyncio.wait_for(payout(ref="r1"), BOUND))
    try:
        await asyncio.wait_for(entered.wait(), BOUND)
    finally:
        consumer.cancel()
        await store.close()  # (no await between the cancellation and the close)
    record = await consumer_cancelled(consumer, db_dsn)
    assert record is not None
    assert record.state is State.UNKNOWN
