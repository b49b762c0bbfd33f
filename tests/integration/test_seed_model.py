"""The seed article's four Go model tests (main_test.go), ported to the real stores.

TestConcurrentExactlyOneLocalClaim, TestPendingAndUnknownNeverSilentlyExpire,
TestConflictRetentionAndStaleOwner and TestTenantScope, each run on the in-memory twin and on
PostgreSQL through the contract suite's harness (tests/contract.py).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from idem_middleware.errors import StoreError
from idem_middleware.store import (
    Claim,
    ClaimBusy,
    Claimed,
    Existing,
    RecordKey,
    State,
    StoredResponse,
)
from tests.contract import FP, OTHER_FP, RESPONSE, TEN_YEARS, Harness, claim, key

pytestmark = pytest.mark.db_routes("pgbouncer", "partitioned")


async def test_concurrent_exactly_one_claim_and_one_effect(harness: Harness) -> None:
    k = key("op-1")
    store = harness.store

    async def attempt() -> Claim:
        # As the middleware does: a busy key is claimed again after a pause (bounded).
        for _ in range(1000):
            try:
                async with harness.transaction() as session:
                    result = await claim(session, k, wait=10)
                    if isinstance(result, Claimed):
                        await harness.effect(session, k)
                        await session.finish(State.SUCCEEDED, RESPONSE)
                    return result
            except ClaimBusy:
                await asyncio.sleep(0.01)
        raise AssertionError("the key stayed busy")

    results = await asyncio.wait_for(asyncio.gather(*(attempt() for _ in range(100))), 30)

    winners = [r for r in results if isinstance(r, Claimed)]
    assert len(winners) == 1, f"{len(winners)} claims for one key"
    assert await harness.effects(k) == 1
    generation = winners[0].generation
    for other in results:
        if isinstance(other, Claimed):
            continue
        assert other.record.generation == generation
        assert isinstance(other, Existing)
        assert other.record.state is State.SUCCEEDED, "a duplicate saw an unfinished record"
        assert other.record.response == RESPONSE
    record = await store.get(k)
    assert record is not None
    assert record.generation == generation
    assert record.state is State.SUCCEEDED


async def test_pending_and_unknown_never_silently_expire(harness: Harness) -> None:
    store = harness.store

    # Transactional pending: an uncommitted claim, however old, is never taken over.
    held_key = key("held")
    async with harness.transaction() as holder:
        held = await claim(holder, held_key)
        assert isinstance(held, Claimed)
        await harness.age(TEN_YEARS, session=holder)
        async with harness.transaction() as other:
            with pytest.raises(ClaimBusy):
                await claim(other, held_key, wait=0.2)
        assert await store.get(held_key) is None

    # Committed (lease-mode) pending and unknown records created ten years ago.
    planted = {
        State.PENDING: (
            key("pending"),
            await harness.put_unresolved(key("pending"), FP, State.PENDING),
        ),
        State.UNKNOWN: (
            key("unknown"),
            await harness.put_unresolved(key("unknown"), FP, State.UNKNOWN),
        ),
    }
    for state, (k, generation) in planted.items():
        for fingerprint in (OTHER_FP, FP):
            async with harness.transaction() as session:
                result = await claim(session, k, fingerprint, wait=1)
                assert isinstance(result, Existing), f"an old {state} record was taken over"
                assert result.record.generation == generation
                assert result.record.fingerprint == FP
                assert not result.record.expired
                lapsed = harness.kind == "postgres" and state is State.PENDING
                if lapsed and fingerprint == OTHER_FP:
                    # The lease lapsed long ago, and still the claim does not take it over.
                    assert result.record.lease_expired
                if lapsed and fingerprint == FP:
                    # Its own request's claim marks it unknown (docs/lease-mode.md, "Changing
                    # a route's mode"): never taken over, never expired.
                    state = State.UNKNOWN
                assert result.record.state is state
        record = await store.get(k)
        assert record is not None
        assert record.state is state
        assert record.generation == generation
        assert not record.expired

    # An unknown outcome cannot blindly be completed: a session finishes only its own claim.
    k, generation = planted[State.UNKNOWN]
    async with harness.transaction(begin=True) as session:
        with pytest.raises(StoreError):
            await session.finish(State.SUCCEEDED, RESPONSE)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.UNKNOWN
    assert record.response is None


@pytest.mark.parametrize("final_state", [State.SUCCEEDED, State.FAILED_FINAL])
async def test_conflict_retention_boundary_and_stale_generation(
    harness: Harness, final_state: State
) -> None:
    k = key("op-1")
    store = harness.store
    outcome = (
        RESPONSE
        if final_state is State.SUCCEEDED
        else StoredResponse(status=402, headers=[], body=b'{"declined":true}')
    )

    async with harness.transaction() as session:
        first = await claim(session, k, FP)
        assert isinstance(first, Claimed)
        await harness.effect(session, k)
        await session.finish(final_state, outcome)

    # Same key, different fingerprint: the existing record comes back (the middleware's 422).
    async with harness.transaction() as session:
        conflict = await claim(session, k, OTHER_FP)
    assert isinstance(conflict, Existing)
    assert conflict.record.fingerprint == FP != OTHER_FP
    assert conflict.record.generation == first.generation

    # One microsecond before the retention ends: a replay.
    async with harness.transaction(begin=True) as session:
        await harness.end_retention(k, after=1e-6, session=session)
        replay = await claim(session, k, FP)
    assert isinstance(replay, Existing)
    assert not replay.record.expired
    assert replay.record.state is final_state
    assert replay.record.response == outcome
    assert replay.record.generation == first.generation

    # Once it has ended the record no longer protects anything.
    await harness.end_retention(k)
    expired = await store.get(k)
    assert expired is not None
    assert expired.expired
    assert expired.generation == first.generation

    # Exactly at the end: a claim takes it over under a new, larger generation.
    async with harness.transaction(begin=True) as session:
        await harness.end_retention(k, after=0.0, session=session)
        takeover = await claim(session, k, FP)
        assert isinstance(takeover, Claimed)
        assert takeover.generation > first.generation
        await harness.effect(session, k)
        await session.finish(State.SUCCEEDED, RESPONSE)
        # A second completion matches nothing (the claim is finished).
        with pytest.raises(StoreError):
            await session.finish(State.SUCCEEDED, RESPONSE)

    # A late executor without the claim (the old generation's) cannot complete anything.
    async with harness.transaction(begin=True) as session:
        with pytest.raises(StoreError):
            await session.finish(State.SUCCEEDED, RESPONSE)

    record = await store.get(k)
    assert record is not None
    assert record.generation == takeover.generation
    assert record.state is State.SUCCEEDED
    assert record.response == RESPONSE
    assert not record.expired
    assert await harness.effects(k) == 2


async def test_tenant_and_operation_scope(harness: Harness) -> None:
    store = harness.store
    keys = [
        RecordKey("tenant-a", "POST /add", "1"),
        RecordKey("tenant-b", "POST /add", "1"),
        RecordKey("tenant-a", "POST /sub", "1"),
    ]
    fingerprints = [bytes([i]) * 32 for i in range(len(keys))]
    responses = [StoredResponse(201, [], f"r{i}".encode()) for i in range(len(keys))]

    # All three claimed at once: none waits on another (a shared scope would time out here).
    async with AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(harness.transaction()) for _ in keys]
        claims = []
        for session, k, fingerprint in zip(sessions, keys, fingerprints, strict=True):
            result = await claim(session, k, fingerprint, wait=0.2)
            assert isinstance(result, Claimed), f"{k} was not independent"
            claims.append(result)
            await harness.effect(session, k)
        for session, response in zip(sessions, responses, strict=True):
            await session.finish(State.SUCCEEDED, response)

    assert len({c.generation for c in claims}) == len(keys)
    for k, result, fingerprint, response in zip(keys, claims, fingerprints, responses, strict=True):
        record = await store.get(k)
        assert record is not None
        assert record.generation == result.generation
        assert record.fingerprint == fingerprint
        assert record.response == response
        assert await harness.effects(k) == 1
    assert await store.get(RecordKey("tenant-b", "POST /sub", "1")) is None
