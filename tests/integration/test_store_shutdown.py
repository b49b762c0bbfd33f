"""Closing the store while requests are in flight (a shutdown whose lifespan ends first): a
request's connection still goes back to its pool, and the close completes; lease-mode requests
and their waiting duplicates end at once with a clear answer."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, RecordKey, get_context
from idem_middleware.errors import StoreClosed
from idem_middleware.store.base import Record
from tests.apps import PROBLEM_BASE, client, one_route_app, wait_for_waiters

BOUND = 10.0


async def test_a_connection_held_across_close_goes_back_to_its_pool(db_dsn: str) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    await store.open()
    closing: asyncio.Task[None] | None = None
    async with store.transaction(acquire_timeout=BOUND) as tx:
        await tx.claim(
            RecordKey("tenant-a", "POST /x", "shutdown-1"),
            b"f" * 32,
            retention_seconds=60,
            wait_seconds=1,
        )
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0.05)
        assert not closing.done(), "the pool's close waits for the connection in use"
    # Leaving the block gave the connection back (to the pool it came from, now closing).
    await asyncio.wait_for(closing, BOUND)


class CountsClosedReads(PostgresStore):
    """Counts the reads and the renewals that found the store closed."""

    closed_reads = 0
    closed_renewals = 0

    async def get(self, key: RecordKey) -> Record | None:
        try:
            return await super().get(key)
        except StoreClosed:
            self.closed_reads += 1
            raise

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        try:
            return await super().heartbeat(key, generation, lease_seconds)
        except StoreClosed:
            self.closed_renewals += 1
            raise


async def test_lease_requests_in_flight_when_the_store_closes_end_at_once(
    db_dsn: str, pool: Any
) -> None:
    """The app's lifespan closes the store while a lease-mode request runs and a duplicate
    waits for it (a server that does not wait for its requests, a test harness). Found by
    probing: the duplicate read the closed store again and again for the rest of its wait
    (`wait_seconds`) before its 503, as it polls on through a server's restart; and the
    original's renewals tried the closed store again each third of the lease, warning each
    time, the handler believing it held its claim until the lease lapsed. Now the duplicate is
    answered `503 store-unavailable` at its first closed read, and the original loses its lease
    at its first renewal (`lease_lost`), then is answered the same."""
    store = CountsClosedReads(dsn=db_dsn, min_size=1, max_size=3)
    await store.open()
    entered, lost = asyncio.Event(), asyncio.Event()

    async def pay(request: Request) -> Response:
        context = get_context(request)
        entered.set()
        await asyncio.wait_for(context.lease_lost.wait(), BOUND)
        lost.set()
        return JSONResponse({"paid": True}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=0.6, wait_seconds=3)
    app = one_route_app("/payouts", pay, store=store, policies={"POST /payouts": policy})
    async with client(app) as c:

        def post() -> Any:
            return c.post("/payouts", json={}, headers={"idempotency-key": "closing-1"})

        original = asyncio.ensure_future(post())
        await asyncio.wait_for(entered.wait(), BOUND)
        duplicate = asyncio.ensure_future(post())
        await wait_for_waiters(app)
        await asyncio.wait_for(store.close(), BOUND)
        answers = await asyncio.wait_for(asyncio.gather(original, duplicate), BOUND)
    assert lost.is_set()
    for r in answers:
        assert (r.status_code, r.json()["type"]) == (503, PROBLEM_BASE + "store-unavailable")
    assert (store.closed_reads, store.closed_renewals) == (1, 1)
    # (Pending until its lease lapses, as any lost settlement: a retry then reconciles it.)
    state = await pool.fetchval("SELECT state FROM idem_requests WHERE idem_key = 'closing-1'")
    assert state == "pending"


async def test_every_caller_of_a_store_whose_given_pool_was_closed_meets_store_closed(
    db_dsn: str,
) -> None:
    """Found by review: with the pool an app gave its store closed by that app, lease mode's
    calls met StoreClosed (asking again cannot help), but a transactional session, the status
    resource's read, a transactional job and the heartbeat met a StoreError counted as a blip
    (asked again), or renewed on their own connection as if nothing had happened."""
    import asyncpg

    from idem_middleware.errors import blip
    from idem_middleware.jobs import idempotent_job

    key = RecordKey("t", "POST /x", "closed-pool")
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    store = PostgresStore(pool=pool, listen=False)
    await store.open()
    await pool.close()

    async def session() -> None:
        async with store.transaction(acquire_timeout=1.0) as tx:
            await tx.claim(key, b"f" * 32, retention_seconds=60, wait_seconds=1)

    @idempotent_job(store, operation="job", key="k")
    async def job(ctx: Any, k: str) -> int:
        raise AssertionError("never run")

    calls = {
        "transaction": session,
        "get": lambda: store.get(key),
        "peek": lambda: store.peek(key),
        "claim_lease": lambda: store.claim_lease(
            key, b"f" * 32, retention_seconds=60, lease_seconds=5
        ),
        "heartbeat": lambda: store.heartbeat(key, 1, 5),
        "stats": lambda: store.stats(),
        "job": lambda: job(k="a"),
    }
    met: dict[str, str] = {}
    for name, call in calls.items():
        try:
            await asyncio.wait_for(call(), BOUND)
            met[name] = "nothing"
        except StoreClosed as exc:
            met[name] = "StoreClosed" if not blip(exc) else "a blip"
        except Exception as exc:  # (what each met, compared below)
            met[name] = type(exc).__name__
    await store.close()
    assert met == dict.fromkeys(calls, "StoreClosed")
