"""The store contract of a transactional claim meeting a lease-mode record of its key: what a
route moved from lease mode to transactional mode finds (docs/lease-mode.md, "Changing a route's
mode"), on every store the contract harness offers (tests/contract.py).

Found by probing: a record released for a retry stayed `pending` for good under a transactional
route (every retry answered `409 request-in-flight`, and neither `reconcile` nor `resolve` would
touch it), and a lapsed lease answered `409 request-in-flight` until an operator ran `reconcile`.
"""

from __future__ import annotations

import asyncio

import pytest

from idem_middleware import RecordKey, State
from idem_middleware.errors import ClaimBusy
from idem_middleware.fence import Verdict, run_reconciler
from idem_middleware.reconcile import NotHappened, ReconcileContext, Reconciliation
from idem_middleware.store import Claimed, Existing
from idem_middleware.store.base import Settlement
from tests.apps import BOUND, PAYOUTS
from tests.contract import FP, OTHER_FP, RESPONSE, Harness, claim

pytestmark = pytest.mark.db_routes("pgbouncer", "partitioned")

OPERATION = f"POST {PAYOUTS}"


def rkey(name: str = "k1") -> RecordKey:
    return RecordKey("tenant-a", OPERATION, name)


async def lease_claim(harness: Harness, k: RecordKey) -> int:
    claimed = await harness.store.claim_lease(k, FP, retention_seconds=3600.0, lease_seconds=30.0)
    assert isinstance(claimed, Claimed)
    return claimed.generation


async def released(harness: Harness, k: RecordKey) -> int:
    """A lease-mode record an operator (or a reconciler) released for the client's retry."""
    store = harness.store
    generation = await lease_claim(harness, k)
    assert await store.settle(k, generation, State.PENDING, Settlement(State.UNKNOWN))
    assert await store.allow_retry(k, generation, "not at the bank")
    record = await store.get(k)
    assert record is not None
    assert record.retry_allowed
    return record.generation


async def test_contract_a_released_lease_record_is_claimed_by_a_transaction(
    harness: Harness,
) -> None:
    store = harness.store
    k = rkey()
    before = await released(harness, k)

    # Rolled back: the record is the released one again, for the next retry.
    async with harness.transaction() as session:
        first = await claim(session, k)
        assert isinstance(first, Claimed)
        assert first.generation > before
        await session.abandon()
    record = await store.get(k)
    assert record is not None
    assert (record.state, record.generation, record.retry_allowed) == (State.PENDING, before, True)

    async with harness.transaction() as session:
        again = await claim(session, k)
        assert isinstance(again, Claimed)
        await harness.effect(session, k)
        await session.finish(State.SUCCEEDED, RESPONSE)
    record = await store.get(k)
    assert record is not None
    assert (record.state, record.generation) == (State.SUCCEEDED, again.generation)
    assert record.response == RESPONSE
    assert await harness.effects(k) == 1

    async with harness.transaction() as session:
        replayed = await claim(session, k)
    assert isinstance(replayed, Existing)
    assert replayed.record.state is State.SUCCEEDED


async def test_contract_a_released_record_of_another_request_is_not_claimed(
    harness: Harness,
) -> None:
    k = rkey()
    generation = await released(harness, k)
    async with harness.transaction() as session:
        found = await claim(session, k, OTHER_FP)  # the caller answers 422 key-reused
    assert isinstance(found, Existing)
    assert (found.record.state, found.record.generation) == (State.PENDING, generation)


async def test_contract_another_request_is_not_answered_from_a_released_record_being_claimed(
    harness: Harness,
) -> None:
    """While a transaction takes a released record over, a claim of the key by another request
    is not answered from that record (found by the model-based test: PostgreSQL waited for the
    transaction's row, the memory store answered at once from the record being taken over), and
    neither waits: the key is busy (ClaimBusy: the caller waits without a connection). Found by
    probing: PostgreSQL's claim waited for the row inside the database, holding its pooled
    connection, until the transaction ended or the claim's wait ran out (ClaimTimeout, a 409
    after the whole wait). Once the transaction commits, a claim finds its outcome."""
    k = rkey()
    await released(harness, k)
    async with harness.transaction() as holder:
        assert isinstance(await claim(holder, k), Claimed)
        for fingerprint in (OTHER_FP, FP):  # another request, and a duplicate of this one
            async with harness.transaction() as other:
                with pytest.raises(ClaimBusy):
                    await asyncio.wait_for(claim(other, k, fingerprint, wait=BOUND), BOUND)
        await holder.finish(State.SUCCEEDED, RESPONSE)
    async with harness.transaction() as later:
        after = await claim(later, k, OTHER_FP)
    assert isinstance(after, Existing)
    assert after.record.state is State.SUCCEEDED


@pytest.mark.parametrize("commits", [True, False])
async def test_contract_a_lease_takeover_is_busy_while_a_transaction_claims_a_released_record(
    harness: Harness, commits: bool
) -> None:
    """An old lease-mode process's retry, in a rolling deploy: it takes the released record
    over only if the transaction that claimed it rolls back; once it commits, never. Meanwhile
    its takeover is busy at once (the duplicate waits without a connection and tries again).
    Found by probing: PostgreSQL's takeover waited for the transaction's row inside the
    database, holding its pooled connection, for up to the duplicate's wait: in a storm (200
    duplicates, a pool of 3) two waiting takeovers took the free connections and 198 requests
    were answered 503."""
    store = harness.store
    k = rkey()
    generation = await released(harness, k)
    async with harness.transaction() as session:
        assert isinstance(await claim(session, k), Claimed)
        with pytest.raises(ClaimBusy):
            await asyncio.wait_for(store.takeover(k, generation, State.PENDING, 30.0), BOUND)
        if commits:
            await session.finish(State.SUCCEEDED, RESPONSE)
    taken = await asyncio.wait_for(store.takeover(k, generation, State.PENDING, 30.0), BOUND)
    record = await store.get(k)
    assert record is not None
    if commits:
        assert taken is None
        assert record.state is State.SUCCEEDED
    else:
        assert taken is not None
        assert (record.state, record.generation) == (State.PENDING, taken)


@pytest.mark.parametrize("commits", [True, False])
async def test_contract_a_lease_claim_is_busy_while_a_transaction_claims_the_key(
    harness: Harness, commits: bool
) -> None:
    """A lease claim (a lease-mode process, its route transactional elsewhere in a rolling
    deploy) of a key a transaction is claiming is busy at once, on every store: the caller
    waits without a connection, then finds the outcome (or claims the key, if the transaction
    rolled back). Found by probing: on PostgreSQL's ordinary path (`fast_path=False`, and every
    token claim), which writes the pending record early, the lease claim's INSERT waited for
    that uncommitted row inside PostgreSQL, holding its pooled connection, for as long as the
    handler ran; on the fast path it claimed and ran the request while the transactional one
    ran it too (one of the two rolled back at commit); the memory store waited for the
    transaction in `claim_lease` itself."""
    store = harness.store
    k = rkey()
    async with harness.transaction() as session:
        assert isinstance(await claim(session, k), Claimed)
        for fingerprint in (FP, OTHER_FP):  # this request's duplicate, and another request
            with pytest.raises(ClaimBusy):
                await asyncio.wait_for(
                    store.claim_lease(k, fingerprint, retention_seconds=60.0, lease_seconds=30.0),
                    BOUND,
                )
        if commits:
            await session.finish(State.SUCCEEDED, RESPONSE)
    after = await store.claim_lease(k, FP, retention_seconds=60.0, lease_seconds=30.0)
    if commits:
        assert isinstance(after, Existing)
        assert after.record.state is State.SUCCEEDED
    else:
        assert isinstance(after, Claimed)


async def test_contract_a_lease_claim_is_busy_while_a_transaction_reclaims_an_expired_record(
    harness: Harness,
) -> None:
    """A finished record whose retention is over, reclaimed by a transaction (a new life): a
    lease claim of the key meanwhile is busy at once, on every store. Found by probing: on
    PostgreSQL the lease claim's `reclaim_expired` waited for that transaction's row inside the
    database, with no bound, its pooled connection held for as long as the handler ran."""
    store = harness.store
    k = rkey()
    async with harness.transaction() as session:
        assert isinstance(await claim(session, k), Claimed)
        await session.finish(State.SUCCEEDED, RESPONSE)
    await harness.end_retention(k)
    async with harness.transaction() as session:
        assert isinstance(await claim(session, k), Claimed)  # the key's new life
        with pytest.raises(ClaimBusy):
            await asyncio.wait_for(
                store.claim_lease(k, FP, retention_seconds=60.0, lease_seconds=30.0), BOUND
            )
        await session.finish(State.SUCCEEDED, RESPONSE)
    after = await store.claim_lease(k, FP, retention_seconds=60.0, lease_seconds=30.0)
    assert isinstance(after, Existing)
    assert (after.record.state, after.record.expired) == (State.SUCCEEDED, False)


async def test_contract_a_lapsed_lease_found_by_a_transactional_claim_becomes_unknown(
    harness: Harness,
) -> None:
    store = harness.store
    k, live, other = rkey(), rkey("live"), rkey("other")
    generation = await lease_claim(harness, k)
    await lease_claim(harness, live)
    await lease_claim(harness, other)
    await harness.lapse(k)
    await harness.lapse(other)
    async with harness.transaction() as session:
        found = await claim(session, k)
    assert isinstance(found, Existing)
    assert (found.record.state, found.record.generation) == (State.UNKNOWN, generation)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.UNKNOWN

    # A live lease is in flight: left as it is. So is another request's lapsed one (422).
    async with harness.transaction() as session:
        running = await claim(session, live)
    async with harness.transaction() as session:
        theirs = await claim(session, other, OTHER_FP)
    for found, name in ((running, live), (theirs, other)):
        assert isinstance(found, Existing)
        assert found.record.state is State.PENDING
        record = await store.get(name)
        assert record is not None
        assert record.state is State.PENDING


async def test_contract_a_lapsed_lease_whose_executor_holds_its_fence_is_not_waited_for(
    harness: Harness,
) -> None:
    """Its executor is still in its fenced transaction, past its lease: the claim neither waits
    for it nor marks it; the record is in flight, and the executor's settlement stands."""
    store = harness.store
    k = rkey()
    generation = await lease_claim(harness, k)
    await harness.lapse(k)
    async with store.fenced(k, generation) as fenced:
        async with harness.transaction() as session:
            found = await asyncio.wait_for(claim(session, k), BOUND)
        assert isinstance(found, Existing)
        assert found.record.state is State.PENDING
        assert await fenced.settle(Settlement(State.SUCCEEDED, RESPONSE))
    record = await store.get(k)
    assert record is not None
    assert record.state is State.SUCCEEDED


async def test_contract_a_reopened_transactional_record_is_never_taken_over_or_reconciled(
    harness: Harness,
) -> None:
    """Found by probing: a transactional record an operator reopened (`unknown`) was taken over
    by a lease-mode retry whose reconciler answered "not happened", and its handler ran again,
    although its writes had committed with its outcome. The store refuses that takeover, and
    `run_reconciler` gives such a record to no reconciler (an operator resolves it)."""
    store = harness.store
    k = rkey()
    async with harness.transaction() as session:
        assert isinstance(await claim(session, k), Claimed)
        await harness.effect(session, k)
        await session.finish(State.SUCCEEDED, RESPONSE)
    record = await store.get(k)
    assert record is not None
    assert await store.amend(k, record.generation, State.SUCCEEDED, Settlement(State.UNKNOWN))
    record = await store.get(k)  # (reopened: under a new generation, as every operator's move)
    assert record is not None
    assert record.state is State.UNKNOWN
    asked: list[str] = []

    async def not_happened(ctx: ReconcileContext) -> Reconciliation:
        asked.append(ctx.downstream_key)
        return NotHappened()

    result = await run_reconciler(store, k, record.generation, not_happened, seconds=BOUND)
    assert result.verdict is Verdict.BY_HAND
    assert asked == []
    assert await store.takeover(k, record.generation, State.UNKNOWN, 30.0) is None
    after = await store.get(k)
    assert after is not None
    assert (after.state, after.generation) == (State.UNKNOWN, record.generation)
    assert await harness.effects(k) == 1

    # A lease-mode record taken over is one, whatever it was: a transactional record released
    # by an older version's reconcile (pending, no lease) is taken over and reconciled later.
    await store.settle(k, record.generation, State.UNKNOWN, Settlement(State.PENDING))
    released = await store.get(k)
    assert released is not None
    generation = await store.takeover(k, released.generation, State.PENDING, 30.0)
    assert generation is not None
    summary = await store.describe(k)
    assert summary is not None
    assert (summary.state, summary.mode) == (State.PENDING, "lease")
