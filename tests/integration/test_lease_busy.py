"""Lease mode meeting a key or a record another session holds (docs/concurrency.md): it never
waits for it inside PostgreSQL with a pooled connection held; it waits in the process, without a
connection, and looks again, and what it cannot have within its wait is `409 request-in-flight`
(`JobInProgress` for a job), never a 500 or a 503.

The route is tests/apps/lease.py's `POST /payouts`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import IdempotencyContext, LeaseExpiry, MemoryStore, Mode, PostgresStore
from idem_middleware.errors import ClaimTimeout
from idem_middleware.jobs import JobInProgress, idempotent_job
from idem_middleware.store import Claimed, Existing
from idem_middleware.store.base import Claim, RecordKey, Settlement, State, Store, StoredResponse
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    assert_problem,
    blocked_by,
    build_lease_app,
    client,
    wait_for_waiters,
)
from tests.integration.test_lease_mode import bank, post  # noqa: F401 (a fixture)
from tests.integration.test_mode_change import _fingerprint_of

DUPLICATES = 60
#: How long a storm's duplicate waits for a connection of the small pool and for the record,
#: and how long the storm takes to come to wait. Each of the 60 takes a connection for its
#: claim and its look (one at a time, on the 2 the holder leaves): 0.5 s answered some 503
#: store-unavailable, and 5 s for all 60 to wait was too short, on a loaded CI machine (5 runs
#: in 48 with the CPUs busy). Waiting inside PostgreSQL (the regression these tests catch)
#: still fails them: those duplicates never wait in the process, so `wait_for_waiters` never
#: sees all 60.
STORM_BOUND = 4 * BOUND


async def test_a_storm_of_duplicates_behind_a_transaction_holding_the_record_takes_no_connection(
    db_dsn: str,
    pool: asyncpg.Pool[Any],
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    """A record released for a retry, taken over by a transaction (its route transactional in
    a rolling deploy) whose handler runs; lease-mode duplicates of it, on a pool of 3. Found by
    probing: each duplicate's takeover waited for the record's row inside PostgreSQL, holding
    its pooled connection, for up to its `wait_seconds`; two such waits took the two free
    connections and the other 198 of 200 duplicates were answered 503 store-unavailable. Now
    every duplicate finds the row held, waits in the process, and replays the outcome."""
    small = await asyncpg.create_pool(db_dsn, min_size=1, max_size=3)
    try:
        async with PostgresStore(pool=small) as store:
            policy = LEASE_POLICY.replace(
                wait_seconds=STORM_BOUND, on_lease_expiry=LeaseExpiry.TAKEOVER
            )
            app = build_lease_app(store, bank, policy, acquire_timeout=STORM_BOUND)
            async with client(app) as c:
                fingerprint = await _fingerprint_of(c, bank)
                key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
                claim = await store.claim_lease(
                    key, fingerprint, retention_seconds=60, lease_seconds=60
                )
                assert isinstance(claim, Claimed)
                unknown = Settlement(State.UNKNOWN)
                assert await store.settle(key, claim.generation, State.PENDING, unknown)
                assert await store.allow_retry(key, claim.generation, "not at the bank")
                async with store.transaction(acquire_timeout=BOUND) as session:
                    taken = await session.claim(
                        key, fingerprint, retention_seconds=60, wait_seconds=BOUND
                    )
                    assert isinstance(taken, Claimed)
                    storm = [asyncio.ensure_future(post(c)) for _ in range(DUPLICATES)]
                    try:
                        await wait_for_waiters(app, DUPLICATES, STORM_BOUND)
                        assert await blocked_by(pool, session.connection) == 0
                        await session.finish(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
                    finally:
                        answered = await asyncio.wait_for(asyncio.gather(*storm), 2 * STORM_BOUND)
    finally:
        await small.close()
    assert {(r.status_code, r.content) for r in answered} == {(201, b"{}")}
    assert app.state.probe.calls == 1  # the fingerprint's "probe" key, none for k1


class ChangingStore(MemoryStore):
    """Answers the first claim with a record in flight (another request's claim, left as it
    is) and every claim after it with ClaimTimeout, as PostgreSQL's claim does when the record
    kept changing under it; and never finds the record, so a duplicate claims again."""

    async def claim_lease(self, key: RecordKey, fingerprint: bytes, **options: Any) -> Claim:
        if await MemoryStore.get(self, key) is not None:
            raise ClaimTimeout("the record kept changing under the claim")
        claimed = await super().claim_lease(key, fingerprint, **options)
        assert isinstance(claimed, Claimed)
        record = await MemoryStore.get(self, key)
        assert record is not None
        return Existing(record)

    async def get(self, key: RecordKey) -> None:
        return None


async def test_a_duplicate_whose_claim_again_times_out_is_in_flight_not_500(
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    """Found by probing: a duplicate that claims the key again (the record it waited on was
    gone, or expired) let the claim's ClaimTimeout escape: 500. It now waits without a
    connection and claims again, for what is left of its wait, then answers 409."""
    app = build_lease_app(ChangingStore(), bank, LEASE_POLICY.replace(wait_seconds=0.2))
    async with client(app) as c:
        assert_problem(await post(c), 409, "request-in-flight")
    assert app.state.probe.calls == 0


async def test_a_lease_jobs_claim_that_times_out_again_is_in_progress() -> None:
    """The same in a lease-mode job: the ClaimTimeout escaped the job's call (not one of the
    job's documented errors); it is JobInProgress after the job's wait."""
    runs: list[str] = []

    @idempotent_job(
        ChangingStore(), operation="payout", key="ref", mode=Mode.LEASE, wait_seconds=0.2
    )
    async def payout(job: IdempotencyContext, *, ref: str) -> str:
        runs.append(ref)
        return "paid"

    with pytest.raises(JobInProgress):
        await asyncio.wait_for(payout(ref="r1"), BOUND)
    assert runs == []


class MetStore:
    """`store`, and an event set once a lease claim has answered (whatever it answered)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.answered = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def claim_lease(self, *args: Any, **kwargs: Any) -> Claim:
        try:
            return await self._store.claim_lease(*args, **kwargs)
        finally:
            self.answered.set()


async def test_a_lease_job_waits_for_a_transactional_run_of_its_key(store: Store) -> None:
    """A job's key run transactionally (the job moved to lease mode in a rolling deploy, say)
    while a lease-mode call of it comes: the lease call's claim answers at once, and the call
    waits (without a connection) and returns the transactional run's result. Found by
    probing: on PostgreSQL's fast path the lease claim claimed the key and ran the job a second
    time meanwhile (the transactional run's commit then met its record and ran again, to find
    it); on the ordinary path it waited for the transaction's row inside PostgreSQL; the memory
    store waited in `claim_lease`."""
    runs: list[str] = []
    entered, gate = asyncio.Event(), asyncio.Event()
    met = MetStore(store)

    async def body(job: IdempotencyContext, *, ref: str) -> str:
        runs.append(ref)
        entered.set()
        await gate.wait()
        return "paid"

    transactional = idempotent_job(store, operation="payout", key="ref", wait_seconds=BOUND)
    lease = idempotent_job(
        met,  # type: ignore[arg-type]
        operation="payout",
        key="ref",
        mode=Mode.LEASE,
        wait_seconds=BOUND,
    )
    first = asyncio.ensure_future(transactional(body)(ref="r1"))
    await asyncio.wait_for(entered.wait(), BOUND)
    second = asyncio.ensure_future(lease(body)(ref="r1"))
    try:
        await asyncio.wait_for(met.answered.wait(), BOUND)
    finally:
        gate.set()
    assert await asyncio.wait_for(first, BOUND) == "paid"
    assert await asyncio.wait_for(second, BOUND) == "paid"
    assert runs == ["r1"]


async def test_a_storm_of_duplicates_behind_an_executor_past_its_lease_takes_no_connection(
    db_dsn: str,
    pool: asyncpg.Pool[Any],
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    """An executor holds its fenced transaction past its lease (stuck or slow); its route marks
    lapsed leases unknown (the default). Found by probing: each duplicate's `expire_lease`
    waited for the record's row inside PostgreSQL, its pooled connection held, for up to its
    `wait_seconds`: on a pool of 3 the waits took every free connection and the rest of 60
    duplicates were answered 503. Now each finds the row held, waits in the process without a
    connection, and replays the outcome the executor settles."""
    small = await asyncpg.create_pool(db_dsn, min_size=1, max_size=3)
    try:
        async with PostgresStore(pool=small) as store:
            policy = LEASE_POLICY.replace(wait_seconds=STORM_BOUND)
            app = build_lease_app(store, bank, policy, acquire_timeout=STORM_BOUND)
            async with client(app) as c:
                fingerprint = await _fingerprint_of(c, bank)
                key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
                claim = await store.claim_lease(
                    key, fingerprint, retention_seconds=60, lease_seconds=60
                )
                assert isinstance(claim, Claimed)
                await pool.execute(  # (its lease lapses: it goes on in its fence)
                    "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
                    " WHERE idem_key = 'k1'"
                )
                async with store.fenced(key, claim.generation) as session:
                    storm = [asyncio.ensure_future(post(c)) for _ in range(DUPLICATES)]
                    try:
                        await wait_for_waiters(app, DUPLICATES, STORM_BOUND)
                        assert await blocked_by(pool, session.connection) == 0
                        response = StoredResponse(201, [], b"{}")
                        assert await session.settle(Settlement(State.SUCCEEDED, response))
                    finally:
                        answered = await asyncio.wait_for(asyncio.gather(*storm), 2 * STORM_BOUND)
    finally:
        await small.close()
    assert {(r.status_code, r.content) for r in answered} == {(201, b"{}")}
    assert app.state.probe.calls == 1  # the fingerprint's "probe" key, none for k1
