"""One contract, two stores: the in-memory twin must behave like the PostgreSQL store.

Every test here runs on `MemoryStore` (with a fake clock) and on `PostgresStore` with its fast
path on and off, directly, through PgBouncer and on a partitioned table: the `harness` fixture
(tests/contract.py) yields a store plus the few things a test needs that the store protocol does
not offer. Sessions begin with their claim, as the middleware's do, so the fast path's fused
BEGIN-and-claim is what runs.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from idem_middleware.errors import StoreError
from idem_middleware.store import (
    ClaimBusy,
    Claimed,
    Existing,
    State,
    StoredResponse,
)
from tests.contract import (
    FP,
    RESPONSE,
    Harness,
    claim,
    claim_in_session,
    key,
)

pytestmark = pytest.mark.db_routes("pgbouncer", "partitioned")


# ---------------------------------------------------------------------------------------------


async def test_claim_is_invisible_until_commit_then_replayed(harness: Harness) -> None:
    k = key()
    store = harness.store
    async with harness.transaction() as session:
        first = await claim(session, k)
        assert isinstance(first, Claimed)
        assert await store.get(k) is None, "an uncommitted claim must not be visible"
        await session.finish(State.SUCCEEDED, RESPONSE)

    record = await store.get(k)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.generation == first.generation
    assert record.fingerprint == FP
    assert record.response == RESPONSE
    assert not record.expired

    async with harness.transaction() as session:
        again = await claim(session, k)
    assert isinstance(again, Existing)
    assert again.record.generation == first.generation
    assert again.record == record


@pytest.mark.parametrize("how", ["explicit", "context-exit"])
async def test_rollback_leaves_nothing(harness: Harness, how: str) -> None:
    k = key()
    store = harness.store
    async with harness.transaction() as session:
        first = await claim(session, k)
        assert isinstance(first, Claimed)
        await harness.effect(session, k)
        if how == "explicit":
            await session.abandon()
    assert await store.get(k) is None
    if harness.kind == "postgres":
        assert await harness.effects(k) == 0, "the business write must roll back with the claim"

    async with harness.transaction() as session:
        second = await claim(session, k)
        assert isinstance(second, Claimed), "a rolled-back claim releases the key"
        assert second.generation > first.generation


async def test_second_claim_in_the_same_session_sees_its_own_pending_claim(
    harness: Harness,
) -> None:
    k = key()
    # begin=True: the fast path's claim defers its record to the completion, and a second claim
    # in the same session does not see it (the middleware never claims twice in one session).
    async with harness.transaction(begin=True) as session:
        first = await claim(session, k)
        assert isinstance(first, Claimed)
        again = await claim(session, k, wait=0.2)
        assert isinstance(again, Existing)
        assert again.record.state is State.PENDING
        assert again.record.generation == first.generation


async def test_a_claim_never_waits_for_another_sessions_claim_of_the_key(harness: Harness) -> None:
    """A duplicate is told at once that the key is busy (ClaimBusy): it must not sit on a pooled
    connection until the holder ends. Its session is rolled back; the holder is unaffected."""
    k = key()
    store = harness.store
    async with harness.transaction() as holder:
        held = await claim(holder, k)
        assert isinstance(held, Claimed)
        async with harness.transaction() as other:
            # However long it was told it may wait: the claim answers without waiting (bounded
            # here by the holder, which stays open until the claim returned).
            with pytest.raises(ClaimBusy):
                await asyncio.wait_for(claim(other, k, wait=30), 10)
        await holder.finish(State.SUCCEEDED, RESPONSE)
    record = await store.get(k)
    assert record is not None
    assert record.generation == held.generation
    assert record.state is State.SUCCEEDED


async def test_a_busy_key_is_answered_from_its_record_once_the_holder_commits(
    harness: Harness,
) -> None:
    k = key()
    async with harness.transaction() as holder:
        held = await claim(holder, k)
        assert isinstance(held, Claimed)
        with pytest.raises(ClaimBusy):
            await claim_in_session(harness, k, wait=10)
        await holder.finish(State.SUCCEEDED, RESPONSE)
    seen = await claim_in_session(harness, k, wait=10)
    assert isinstance(seen, Existing)
    assert seen.record.generation == held.generation
    assert seen.record.state is State.SUCCEEDED
    assert seen.record.response == RESPONSE


async def test_a_busy_key_is_claimed_once_the_holder_rolls_back(harness: Harness) -> None:
    k = key()
    store = harness.store
    async with harness.transaction() as holder:
        held = await claim(holder, k)
        assert isinstance(held, Claimed)
        with pytest.raises(ClaimBusy):
            await claim_in_session(harness, k, wait=10)
        await holder.abandon()
    seen = await claim_in_session(harness, k, wait=10)
    assert isinstance(seen, Claimed)
    assert seen.generation > held.generation
    record = await store.get(k)
    assert record is not None
    assert record.generation == seen.generation
    assert record.state is State.SUCCEEDED


async def test_a_replay_takes_no_lock_while_another_session_holds_the_keys_lock(
    harness: Harness,
) -> None:
    """A settled record is answered while another transaction holds the key's lock (a claim
    that is reclaiming it, say): replays never queue behind each other or behind a claim."""
    k = key()
    await claim_in_session(harness, k, wait=10)
    async with harness.transaction(begin=True) as holder:
        await harness.hold_key_lock(holder, k)
        async with harness.transaction() as session:
            seen = await asyncio.wait_for(claim(session, k, wait=10), 5)
    assert isinstance(seen, Existing)
    assert seen.record.state is State.SUCCEEDED


@pytest.mark.parametrize(
    ("state", "response"),
    [
        pytest.param(
            State.SUCCEEDED,
            StoredResponse(
                status=201,
                headers=[
                    (b"content-type", b"application/octet-stream"),
                    (b"x-latin-1", b"caf\xe9 \xff\x80"),
                    (b"x-repeated", b"one"),
                    (b"x-repeated", b"two"),
                    (b"x-empty", b""),
                ],
                body=b"\x00\xff\xfe binary \x80\r\n",
                body_omitted=None,
            ),
            id="succeeded-binary",
        ),
        pytest.param(
            State.FAILED_FINAL,
            StoredResponse(status=402, headers=[], body=b"", body_omitted="too-large"),
            id="failed-final-omitted",
        ),
        pytest.param(
            State.SUCCEEDED,
            StoredResponse(
                status=200,
                headers=[(b"content-type", b"text/event-stream")],
                body=b"",
                body_omitted="streaming",
            ),
            id="succeeded-streaming",
        ),
    ],
)
async def test_stored_response_round_trips_exactly(
    harness: Harness, state: State, response: StoredResponse
) -> None:
    k = key()
    store = harness.store
    async with harness.transaction() as session:
        first = await claim(session, k)
        assert isinstance(first, Claimed)
        await session.finish(state, response)

    record = await store.get(k)
    assert record is not None
    assert record.state is state
    assert record.response is not None
    got = record.response
    assert got.status == response.status
    assert [(bytes(n), bytes(v)) for n, v in got.headers] == list(response.headers)
    assert got.body == response.body
    assert type(got.body) is bytes
    assert got.body_omitted == response.body_omitted

    async with harness.transaction() as session:
        replay = await claim(session, k)
    assert isinstance(replay, Existing)
    assert replay.record.state is state
    assert replay.record.response is not None
    assert list(replay.record.response.headers) == list(response.headers)
    assert replay.record.response.body == response.body
    assert replay.record.response.status == response.status
    assert replay.record.response.body_omitted == response.body_omitted


async def test_generations_are_unique_and_increase_across_purge_and_reclaim(
    harness: Harness,
) -> None:
    k = key()
    store = harness.store
    seen: list[int] = []
    for _ in range(4):
        async with harness.transaction() as session:
            result = await claim(session, k)
            assert isinstance(result, Claimed), "a purged key is absent and can be claimed"
            await session.finish(State.SUCCEEDED, RESPONSE)
        seen.append(result.generation)
        # Another key's claim draws from the same counter in between.
        other = await claim_in_session(harness, key(f"other-{len(seen)}"), wait=1)
        assert isinstance(other, Claimed)
        seen.append(other.generation)
        await harness.purge(k)
        assert await store.get(k) is None
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen), f"a generation was reused: {seen}"


async def test_finish_without_holding_the_claim_is_refused(harness: Harness) -> None:
    """A session finishes only a claim it holds: not one it did not make, not one it has
    finished already, not one whose record it was only shown."""
    k = key()
    store = harness.store
    first = await claim_in_session(harness, k, wait=1)
    assert isinstance(first, Claimed)
    async with harness.transaction(begin=True) as session:
        # Nothing claimed in this session.
        with pytest.raises(StoreError):
            await session.finish(State.FAILED_FINAL, RESPONSE)
    async with harness.transaction() as session:
        # Shown the finished record: there is nothing to finish.
        assert isinstance(await claim(session, k), Existing)
        with pytest.raises(StoreError):
            await session.finish(State.FAILED_FINAL, RESPONSE)
    async with harness.transaction() as session:
        mine = await claim(session, key("once"))
        assert isinstance(mine, Claimed)
        await session.finish(State.SUCCEEDED, RESPONSE)
        with pytest.raises(StoreError):  # finished already
            await session.finish(State.FAILED_FINAL, RESPONSE)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.SUCCEEDED
    once = await store.get(key("once"))
    assert once is not None
    assert once.state is State.SUCCEEDED


async def test_open_sessions_on_different_keys_do_not_block_each_other(
    harness: Harness,
) -> None:
    keys = [key(f"k{i}") for i in range(3)]
    async with AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(harness.transaction()) for _ in keys]
        claims = [await claim(s, k, wait=0.2) for s, k in zip(sessions, keys, strict=True)]
        assert all(isinstance(c, Claimed) for c in claims)
        assert len({c.generation for c in claims}) == len(claims)
