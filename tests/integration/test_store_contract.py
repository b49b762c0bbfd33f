"""One contract, two stores: the in-memory twin must behave like the PostgreSQL store.

Every test here runs twice, on `MemoryStore` (with a fake clock) and on `PostgresStore` (a real
PostgreSQL; time is simulated by editing rows, since `now()` is the database's clock). The
`harness` fixture yields a store plus the few things a test needs that the store protocol does
not offer: ending a key's retention, purging a key, planting an old unresolved record, recording a
business effect and waiting until a claim is blocked on another session.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import AsyncExitStack
from typing import Any

import asyncpg
import pytest

from idem_middleware.errors import StoreError
from idem_middleware.store import (
    Claim,
    ClaimBusy,
    MemoryStore,
    RecordKey,
    State,
    StoredResponse,
)
from idem_middleware.store.memory import _Row
from idem_middleware.store.postgres import PostgresStore

STORE_KINDS = ["memory", "postgres"]

FP = b"\x01" * 32
OTHER_FP = b"\x02" * 32
RETENTION = 3600.0
TEN_YEARS = 10 * 365 * 24 * 3600.0
RESPONSE = StoredResponse(
    status=201,
    headers=[(b"content-type", b"application/json")],
    body=b'{"ok":true}',
)


def key(name: str = "k1", *, tenant: str = "tenant-a", operation: str = "POST /x") -> RecordKey:
    return RecordKey(tenant, operation, name)


async def claim(session: Any, k: RecordKey, fingerprint: bytes = FP, *, wait: float = 5.0) -> Claim:
    return await session.claim(k, fingerprint, retention_seconds=RETENTION, wait_seconds=wait)


class FakeClock:
    """The memory store's `now()`: moves only when a test moves it."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class MemoryHarness:
    kind = "memory"

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock)
        self._effects: Counter[RecordKey] = Counter()

    async def effect(self, session: Any, k: RecordKey) -> None:
        # The twin has no business tables: an effect is counted when the claimer performs it.
        self._effects[k] += 1

    async def effects(self, k: RecordKey) -> int:
        return self._effects[k]

    async def end_retention(self, k: RecordKey, *, after: float = 0.0, session: Any = None) -> None:
        """Make the key's retention end `after` seconds from the store's now (0: it ends now)."""
        row = self.store._rows[k]
        assert row.expires_at is not None, "only a finished record has a retention end"
        self.clock.now = row.expires_at - after

    async def purge(self, k: RecordKey) -> None:
        del self.store._rows[k]

    async def put_unresolved(self, k: RecordKey, fingerprint: bytes, state: State) -> int:
        """A committed pending/unknown record, then ten years pass."""
        generation = next(self.store._generations)
        self.store._rows[k] = _Row(fingerprint, state, generation, RETENTION)
        self.clock.now += TEN_YEARS
        return generation

    async def age(self, seconds: float, *, session: Any = None) -> None:
        self.clock.now += seconds

    async def hold_key_lock(self, session: Any, k: RecordKey) -> None:
        """Make `session` hold the key as an uncommitted claim does (until it ends)."""
        event = asyncio.Event()
        session._store._owners[k] = event
        session._held[k] = event


class PgHarness:
    kind = "postgres"

    def __init__(self, store: PostgresStore, pool: asyncpg.Pool[Any]) -> None:
        self.store = store
        self.pool = pool

    async def effect(self, session: Any, k: RecordKey) -> None:
        # On the session's connection, inside the claim's transaction.
        await session.connection.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, $2, 1)",
            k.tenant,
            f"{k.operation}|{k.key}",
        )

    async def effects(self, k: RecordKey) -> int:
        count: int = await self.pool.fetchval(
            "SELECT count(*) FROM test_ledger WHERE tenant = $1 AND account_id = $2",
            k.tenant,
            f"{k.operation}|{k.key}",
        )
        return count

    async def end_retention(self, k: RecordKey, *, after: float = 0.0, session: Any = None) -> None:
        """expires_at = now() + after; inside `session` that is the very now() its claim sees."""
        conn = self.pool if session is None else session.connection
        status = await conn.execute(
            "UPDATE idem_requests SET expires_at = now() + make_interval(secs => $4::float8)"
            " WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND expires_at IS NOT NULL",
            k.tenant,
            k.operation,
            k.key,
            after,
        )
        assert status == "UPDATE 1", "only a finished record has a retention end"

    async def purge(self, k: RecordKey) -> None:
        status = await self.pool.execute(
            "DELETE FROM idem_requests WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
            k.tenant,
            k.operation,
            k.key,
        )
        assert status == "DELETE 1"

    async def put_unresolved(self, k: RecordKey, fingerprint: bytes, state: State) -> int:
        """A lease-mode pending/unknown record created ten years ago (a pending one's lease too)."""
        generation: int = await self.pool.fetchval(
            """
            INSERT INTO idem_requests AS r (tenant, operation, idem_key, fingerprint, state, mode,
                                            retention, created_at, updated_at, lease_expires_at)
            VALUES ($1, $2, $3, $4, $5, 'lease', interval '1 hour',
                    now() - interval '10 years', now() - interval '10 years',
                    CASE WHEN $5 = 'pending' THEN now() - interval '10 years' END)
            RETURNING r.generation
            """,
            k.tenant,
            k.operation,
            k.key,
            fingerprint,
            state.value,
        )
        return generation

    async def age(self, seconds: float, *, session: Any = None) -> None:
        conn = self.pool if session is None else session.connection
        await conn.execute(
            "UPDATE idem_requests SET created_at = created_at - make_interval(secs => $1::float8),"
            " updated_at = updated_at - make_interval(secs => $1::float8)",
            seconds,
        )

    async def hold_key_lock(self, session: Any, k: RecordKey) -> None:
        """Make `session` hold the key's advisory lock, as an uncommitted claim does."""
        await session.connection.execute(
            "SELECT pg_advisory_xact_lock(idem_key_lock($1, $2, $3))",
            k.tenant,
            k.operation,
            k.key,
        )


Harness = MemoryHarness | PgHarness


def build_harness(request: pytest.FixtureRequest) -> Harness:
    if request.param == "memory":
        return MemoryHarness()
    # Only the postgres variant needs the database (the pool fixture truncates the tables).
    pool = request.getfixturevalue("pool")
    store = request.getfixturevalue("pg_store")
    return PgHarness(store, pool)


@pytest.fixture(params=STORE_KINDS)
def harness(request: pytest.FixtureRequest) -> Harness:
    return build_harness(request)


async def _claim_in_session(
    harness: Harness, k: RecordKey, *, wait: float, complete: bool = True
) -> Claim:
    async with harness.store.transaction(acquire_timeout=10) as session:
        result = await claim(session, k, wait=wait)
        if result.claimed and complete:
            await session.complete(k, result.generation, State.SUCCEEDED, RESPONSE)
            await session.commit()
        return result


# ---------------------------------------------------------------------------------------------


async def test_claim_is_invisible_until_commit_then_replayed(harness: Harness) -> None:
    k = key()
    store = harness.store
    async with store.transaction(acquire_timeout=10) as session:
        first = await claim(session, k)
        assert first.claimed
        assert first.record is None
        assert await store.get(k) is None, "an uncommitted claim must not be visible"
        await session.complete(k, first.generation, State.SUCCEEDED, RESPONSE)
        assert await store.get(k) is None, "an uncommitted outcome must not be visible"
        await session.commit()

    record = await store.get(k)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.generation == first.generation
    assert record.fingerprint == FP
    assert record.response == RESPONSE
    assert not record.expired

    async with store.transaction(acquire_timeout=10) as session:
        again = await claim(session, k)
    assert not again.claimed
    assert again.generation == first.generation
    assert again.record == record


@pytest.mark.parametrize("how", ["explicit", "context-exit"])
async def test_rollback_leaves_nothing(harness: Harness, how: str) -> None:
    k = key()
    store = harness.store
    async with store.transaction(acquire_timeout=10) as session:
        first = await claim(session, k)
        assert first.claimed
        await harness.effect(session, k)
        await session.complete(k, first.generation, State.SUCCEEDED, RESPONSE)
        if how == "explicit":
            await session.rollback()
    assert await store.get(k) is None
    if harness.kind == "postgres":
        assert await harness.effects(k) == 0, "the business write must roll back with the claim"

    async with store.transaction(acquire_timeout=10) as session:
        second = await claim(session, k)
        assert second.claimed, "a rolled-back claim releases the key"
        assert second.generation > first.generation


async def test_second_claim_in_the_same_session_sees_its_own_pending_claim(
    harness: Harness,
) -> None:
    k = key()
    async with harness.store.transaction(acquire_timeout=10) as session:
        first = await claim(session, k)
        assert first.claimed
        again = await claim(session, k, wait=0.2)
        assert not again.claimed
        assert again.record is not None
        assert again.record.state is State.PENDING
        assert again.generation == first.generation


async def test_a_claim_never_waits_for_another_sessions_claim_of_the_key(harness: Harness) -> None:
    """A duplicate is told at once that the key is busy (ClaimBusy): it must not sit on a pooled
    connection until the holder ends. Its session is rolled back; the holder is unaffected."""
    k = key()
    store = harness.store
    async with store.transaction(acquire_timeout=10) as holder:
        held = await claim(holder, k)
        assert held.claimed
        async with store.transaction(acquire_timeout=10) as other:
            # However long it was told it may wait: the claim answers without waiting (bounded
            # here by the holder, which stays open until the claim returned).
            with pytest.raises(ClaimBusy):
                await asyncio.wait_for(claim(other, k, wait=30), 10)
        await holder.complete(k, held.generation, State.SUCCEEDED, RESPONSE)
        await holder.commit()
    record = await store.get(k)
    assert record is not None
    assert record.generation == held.generation
    assert record.state is State.SUCCEEDED


async def test_a_busy_key_is_answered_from_its_record_once_the_holder_commits(
    harness: Harness,
) -> None:
    k = key()
    store = harness.store
    async with store.transaction(acquire_timeout=10) as holder:
        held = await claim(holder, k)
        assert held.claimed
        with pytest.raises(ClaimBusy):
            await _claim_in_session(harness, k, wait=10)
        await holder.complete(k, held.generation, State.SUCCEEDED, RESPONSE)
        await holder.commit()
    seen = await _claim_in_session(harness, k, wait=10)
    assert not seen.claimed
    assert seen.generation == held.generation
    assert seen.record is not None
    assert seen.record.state is State.SUCCEEDED
    assert seen.record.response == RESPONSE


async def test_a_busy_key_is_claimed_once_the_holder_rolls_back(harness: Harness) -> None:
    k = key()
    store = harness.store
    async with store.transaction(acquire_timeout=10) as holder:
        held = await claim(holder, k)
        assert held.claimed
        with pytest.raises(ClaimBusy):
            await _claim_in_session(harness, k, wait=10)
        await holder.rollback()
    seen = await _claim_in_session(harness, k, wait=10)
    assert seen.claimed
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
    store = harness.store
    await _claim_in_session(harness, k, wait=10)
    async with store.transaction(acquire_timeout=10) as holder:
        await harness.hold_key_lock(holder, k)
        # As the middleware claims: BEGIN travels with the claim (the fast path).
        async with store.transaction(acquire_timeout=10, begin=False) as session:
            seen = await asyncio.wait_for(claim(session, k, wait=10), 5)
    assert not seen.claimed
    assert seen.record is not None
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
    async with store.transaction(acquire_timeout=10) as session:
        first = await claim(session, k)
        assert first.claimed
        await session.complete(k, first.generation, state, response)
        await session.commit()

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

    async with store.transaction(acquire_timeout=10) as session:
        replay = await claim(session, k)
    assert not replay.claimed
    assert replay.record is not None
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
        async with store.transaction(acquire_timeout=10) as session:
            result = await claim(session, k)
            assert result.claimed, "a purged key is absent and can be claimed"
            await session.complete(k, result.generation, State.SUCCEEDED, RESPONSE)
            await session.commit()
        seen.append(result.generation)
        # Another key's claim draws from the same counter in between.
        other = await _claim_in_session(harness, key(f"other-{len(seen)}"), wait=1)
        assert other.claimed
        seen.append(other.generation)
        await harness.purge(k)
        assert await store.get(k) is None
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen), f"a generation was reused: {seen}"


async def test_complete_without_holding_the_claim_is_refused(harness: Harness) -> None:
    k = key()
    store = harness.store
    first = await _claim_in_session(harness, k, wait=1)
    assert first.claimed
    async with store.transaction(acquire_timeout=10) as session:
        # The record is finished: no session holds a pending claim on it any more.
        with pytest.raises(StoreError):
            await session.complete(k, first.generation, State.FAILED_FINAL, RESPONSE)
        # And a key nobody ever claimed.
        with pytest.raises(StoreError):
            await session.complete(key("never"), first.generation, State.SUCCEEDED, RESPONSE)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert await store.get(key("never")) is None


async def test_open_sessions_on_different_keys_do_not_block_each_other(
    harness: Harness,
) -> None:
    store = harness.store
    keys = [key(f"k{i}") for i in range(3)]
    async with AsyncExitStack() as stack:
        sessions = [
            await stack.enter_async_context(store.transaction(acquire_timeout=10)) for _ in keys
        ]
        claims = [await claim(s, k, wait=0.2) for s, k in zip(sessions, keys, strict=True)]
        assert all(c.claimed for c in claims)
        assert len({c.generation for c in claims}) == len(claims)
