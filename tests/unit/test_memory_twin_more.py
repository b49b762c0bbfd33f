"""More of PostgreSQL's semantics the twin copies (and one the fast path did not keep): a
released record a transaction takes over keeps its audit trail; two claims in one session agree
on every store; an operator's move without a note appends no line, answers a live lease at once
while its row is held, and waits for a held row at most the lock_timeout; purge's limits bound
the tokens it deletes too; and a lease claim judges its token before the key's busy record.
Each test runs on both stores (`harness`)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from idem_middleware.errors import ClaimBusy, StoreError
from idem_middleware.keys import token_hash
from idem_middleware.ops import Resolution, resolve
from idem_middleware.store import Claimed, Existing, RecordKey, State, TokenRefused
from idem_middleware.store.base import Settlement
from idem_middleware.store.memory import edges
from tests.contract import RESPONSE, Harness, MemoryHarness
from tests.contract import claim as claim_in
from tests.unit.test_memory_twin_locks import AT_ONCE, K, _pending

K2 = RecordKey("t", "POST /p", "k2")


async def _expire_all(harness: Harness, seconds: float) -> None:
    """Move every record's and token's expiry `seconds` into the past (the twin: its clock)."""
    if isinstance(harness, MemoryHarness):
        harness.clock.now += seconds
        return
    for table in ("idem_requests", "idem_tokens"):
        await harness.pool.execute(
            f"UPDATE {table} SET expires_at = expires_at - make_interval(secs => $1::float8)"
            " WHERE expires_at IS NOT NULL",
            seconds,
        )


async def _tokens_left(harness: Harness) -> set[bytes]:
    if isinstance(harness, MemoryHarness):
        return {hashed for _, hashed in harness.store._tokens}
    rows = await harness.pool.fetch("SELECT token_hash FROM idem_tokens")
    return {bytes(row["token_hash"]) for row in rows}


async def test_a_released_record_a_transaction_takes_over_keeps_its_trail(
    harness: Harness,
) -> None:
    """A lease-mode record released for a retry, then claimed by a transaction (its route moved
    to transactional mode) and finished: its audit trail and creation time stay (queries.sql
    `reclaim_released` and `complete`); the twin wrote a new row without them."""
    store = harness.store
    generation = await _pending(harness, lapsed=True)
    assert await store.expire_lease(K, generation)
    await resolve(store, K, Resolution.RETRY, note="did not happen")
    before = await store.describe(K)
    assert before is not None
    assert before.note is not None
    assert before.note.endswith("did not happen")
    await harness.tick()
    async with harness.transaction() as tx:
        claimed = await claim_in(tx, K, b"f")
        assert isinstance(claimed, Claimed)
        await tx.finish(State.SUCCEEDED, RESPONSE)
    after = await store.describe(K)
    assert after is not None
    assert (after.state, after.mode, after.generation, after.epoch) == (
        State.SUCCEEDED,
        "transactional",
        claimed.generation,
        claimed.generation,
    )
    assert (after.note, after.created_at) == (before.note, before.created_at)
    assert after.updated_at > before.updated_at


async def test_two_claims_in_one_session_agree_on_every_store(harness: Harness) -> None:
    """The fast path's first claim writes its record at completion: a second claim in the same
    session claimed that key again, and the completion then wrote the first claim's record for
    the last key (a unique violation: RetryableConflict, every time). Its record is written as
    the second claim begins now, as the ordinary path's and the twin's are."""
    store = harness.store
    async with harness.transaction() as tx:
        first = await claim_in(tx, K)
        again = await claim_in(tx, K)
        second = await claim_in(tx, K2)
        second_again = await claim_in(tx, K2)
        assert isinstance(first, Claimed)
        assert isinstance(second, Claimed)
        assert isinstance(again, Existing)
        assert isinstance(second_again, Existing)
        assert (again.record.state, again.record.generation) == (State.PENDING, first.generation)
        assert (second_again.record.state, second_again.record.generation) == (
            State.PENDING,
            second.generation,
        )
        await tx.finish(State.SUCCEEDED, RESPONSE)
    one, two = await store.get(K), await store.get(K2)
    assert one is not None
    assert two is not None
    assert (one.state, one.generation, one.epoch, one.response) == (
        State.PENDING,
        first.generation,
        first.generation,
        None,
    )
    assert (two.state, two.generation, two.response) == (
        State.SUCCEEDED,
        second.generation,
        RESPONSE,
    )


async def test_a_session_holding_a_claim_keeps_what_its_later_claims_touched(
    harness: Harness,
) -> None:
    """A later claim in a session that holds a claim does not end it: a refused token keeps the
    key's claim lock PostgreSQL's claim took to judge it (the key is busy to others, and `peek`
    sees it claimed, until the session ends), and a lapsed lease-mode record it finds is left
    as it is (PostgreSQL marks one `unknown` only after a session that claimed nothing). The
    twin let the key go, and marked the record at once."""
    store = harness.store
    tok = RecordKey("t", "POST /p", "tok")
    generation = await _pending(harness, lapsed=True)  # K: a lease-mode record, lapsed
    async with harness.transaction() as tx:
        assert isinstance(await claim_in(tx, K2), Claimed)
        refused = await tx.claim(
            tok, b"f", retention_seconds=60, wait_seconds=5, token_hash=token_hash(tok.key)
        )
        assert isinstance(refused, TokenRefused)
        with pytest.raises(ClaimBusy):
            await store.claim_lease(
                tok, b"f", retention_seconds=60, lease_seconds=30, token_hash=token_hash(tok.key)
            )
        assert await store.peek(tok) == (None, True)
        found = await claim_in(tx, K, b"f")
        assert isinstance(found, Existing)
        assert (found.record.state, found.record.lease_expired) == (State.PENDING, True)
        await tx.finish(State.SUCCEEDED, RESPONSE)
    assert await store.peek(tok) == (None, False)
    left = await store.get(K)
    assert left is not None
    assert (left.state, left.generation) == (State.PENDING, generation)
    two = await store.get(K2)
    assert two is not None
    assert two.state is State.SUCCEEDED


async def test_an_operators_move_without_a_note_appends_no_line(harness: Harness) -> None:
    """queries.sql `amend` joins the trail with concat_ws, which skips a NULL line (and makes an
    empty trail of no trail at all); the twin appended a stamped empty line."""
    store = harness.store
    generation = await _pending(harness)
    assert await store.settle(K, generation, State.PENDING, Settlement(State.UNKNOWN))
    assert await store.amend(K, generation, State.UNKNOWN, Settlement(State.SUCCEEDED, RESPONSE))
    moved = await store.describe(K)
    assert moved is not None
    assert moved.note == ""
    redone = Settlement(State.SUCCEEDED, RESPONSE, note="checked")
    assert await store.amend(K, moved.generation, State.SUCCEEDED, redone)
    noted = await store.describe(K)
    assert noted is not None
    assert noted.note is not None
    assert noted.note.startswith("\n")
    assert noted.note.endswith(" checked")
    again = Settlement(State.SUCCEEDED, RESPONSE)
    assert await store.amend(K, noted.generation, State.SUCCEEDED, again)
    last = await store.describe(K)
    assert last is not None
    assert (last.note, last.generation > noted.generation) == (noted.note, True)


async def test_an_operators_move_of_a_live_lease_while_fenced_is_false_at_once(
    harness: Harness,
) -> None:
    """A pending lease-mode record whose lease runs is no record `amend` moves: PostgreSQL's
    UPDATE does not match it and never waits for its row. The twin waited for the executor's
    fenced session."""
    store = harness.store
    generation = await _pending(harness)  # its lease runs
    move = Settlement(State.SUCCEEDED, RESPONSE, note="x")
    async with store.fenced(K, generation):
        amended = store.amend(K, generation, State.PENDING, move)
        assert await asyncio.wait_for(amended, AT_ONCE) is False
    record = await store.get(K)
    assert record is not None
    assert (record.state, record.generation) == (State.PENDING, generation)


async def test_an_operators_move_waits_for_a_fenced_row_at_most_the_lock_timeout(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's `amend` waits for a held row 6 s (its lock_timeout), then is refused; the
    twin waited for as long as the fenced session lasted. (The twin's bound is shortened here.
    PostgreSQL's 6 s are waited by test_cli_hardening2.py's
    `test_an_operators_move_waits_for_a_held_row_a_bounded_time_on_the_server`.)"""
    if harness.kind == "postgres":
        pytest.skip("PostgreSQL's own bound is waited once, by test_cli_hardening2.py")
    assert edges._OWNER_POLLS / 100 == 6.0  # the bound it shares with PostgreSQL
    bound = 0.5
    monkeypatch.setattr(edges, "_OWNER_POLLS", 50)
    store = harness.store
    generation = await _pending(harness, lapsed=True)
    move = Settlement(State.SUCCEEDED, RESPONSE, note="x")
    loop = asyncio.get_running_loop()
    async with store.fenced(K, generation):
        started = loop.time()
        with pytest.raises(StoreError, match="lock_timeout"):
            await asyncio.wait_for(store.amend(K, generation, State.PENDING, move), bound + 4)
        waited = loop.time() - started
    assert bound - 0.1 < waited < bound + 2
    assert await store.amend(K, generation, State.PENDING, move) is True  # held no longer


async def test_purge_deletes_at_most_its_batches_of_records_and_tokens_oldest_first(
    harness: Harness,
) -> None:
    """With batch_size=1 and max_batches=2, PostgreSQL deletes the two records and the two
    tokens that expired first (its batches are ordered by expiry); the twin deleted every
    expired token, and records in the order they were written."""
    store = harness.store
    keys = [RecordKey("t", "POST /p", f"r{i}") for i in range(3)]
    for k, retention in zip(keys, (300.0, 100.0, 200.0), strict=True):
        async with harness.transaction() as tx:
            claimed = await tx.claim(k, b"f", retention_seconds=retention, wait_seconds=5)
            assert isinstance(claimed, Claimed)
            await tx.finish(State.SUCCEEDED, RESPONSE)
    hashes = [hashlib.sha256(b"token %d" % i).digest() for i in range(3)]
    for hashed, ttl in zip(hashes, (300.0, 100.0, 200.0), strict=True):
        await store.issue_token(
            "t", hashed, "POST /p", request_digest=None, intent_id=None, ttl_seconds=ttl
        )
    await _expire_all(harness, 1000.0)
    assert await store.purge(batch_size=1, max_batches=2) == 2
    assert [await store.get(k) is not None for k in keys] == [True, False, False]
    assert await _tokens_left(harness) == {hashes[0]}


async def test_a_lease_claims_token_is_judged_before_a_record_being_reclaimed(
    harness: Harness,
) -> None:
    """A finished record past its retention, claimed again by a transaction still running: a
    lease claim of the key with a token that is no live token is refused for its token, as
    PostgreSQL's claim judges it before it tries the record's row (the twin said busy); with a
    live token it is busy, and the token stays unused. A key with no record at all is busy
    first, whatever the token (PostgreSQL's claim lock)."""
    store = harness.store
    async with harness.transaction() as tx:
        assert isinstance(await claim_in(tx, K), Claimed)
        await tx.finish(State.SUCCEEDED, RESPONSE)
    await harness.end_retention(K)
    hashed = token_hash(K.key)

    async def lease_claim(k: RecordKey) -> Any:
        return await store.claim_lease(
            k, b"\x01" * 32, retention_seconds=60, lease_seconds=30, token_hash=token_hash(k.key)
        )

    async with harness.transaction() as tx:
        assert isinstance(await claim_in(tx, K), Claimed)  # its retention over: claimed again
        refused = await lease_claim(K)
        assert refused == TokenRefused("This key is not a token issued to you for this operation.")
        await store.issue_token(
            K.tenant, hashed, K.operation, request_digest=None, intent_id=None, ttl_seconds=600
        )
        with pytest.raises(ClaimBusy):
            await lease_claim(K)
        async with harness.transaction() as other:
            assert isinstance(await claim_in(other, K2), Claimed)
            with pytest.raises(ClaimBusy):
                await lease_claim(K2)
            await other.abandon()
        await tx.abandon()
    claimed = await lease_claim(K)  # the token was not spent by the busy claim
    assert isinstance(claimed, Claimed)
