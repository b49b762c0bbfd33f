"""Interleavings that once broke exactly-once (issue 19, items 2 to 6), each forced
deterministically: events inside handlers and senders, a transaction held open by the test, a
loopback server that accepts and never answers.

The failure window each one closes is listed in docs/failure-windows.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from idem_middleware import MemoryStore, Mode, Policy, PostgresStore, RecordKey
from idem_middleware import outbox as ob
from idem_middleware.context import token_hash
from idem_middleware.sql import queries
from idem_middleware.store import Claimed, TokenRefused
from idem_middleware.store.base import Settlement, State, StoredResponse
from idem_middleware.store.postgres import _claim
from idem_middleware.tokens import TokenConflict, TokenIssuer
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    Step,
    assert_problem,
    build_app,
    build_lease_app,
    client,
    downstream_reconciler,
    downstream_rows,
    reset_downstream,
)

_Q = queries()
SECRET = b"s" * 32
CREDITS_OP = "POST /accounts/{account_id}/credits"
CREDITS_URL = "/accounts/t1/credits"
PAYOUTS_OP = f"POST {PAYOUTS}"
BODY = {"account": "acc-1", "amount": 100}


@pytest.fixture
async def bank(pool: asyncpg.Pool[Any]) -> asyncpg.Pool[Any]:
    await reset_downstream(pool)
    return pool


async def until(predicate: Any, what: str) -> None:
    """Poll `predicate` (an async callable), at most BOUND seconds."""
    for _ in range(int(BOUND / 0.01)):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- item 2: a key reused after its retention is a new life, downstream too --------------------


async def test_a_reclaimed_key_gets_a_new_downstream_key_and_its_reconciler_sees_it(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """Life 1 succeeds; retention passes and the record is purged; life 2's executor makes the
    transfer and loses the answer (unknown); the retry's reconciler must ask about life 2's
    downstream key. With the key-space-only key, life 2 was deduplicated into life 1's transfer
    and the reconciler found life 1's."""
    policy = LEASE_POLICY.replace(reconciler=downstream_reconciler(bank))
    app = build_lease_app(pg_store, bank, policy)
    probe = app.state.probe
    probe.steps = [Step(), Step(fail="after")]
    async with client(app) as c:
        headers = {"idempotency-key": "k1"}
        first = await c.post(PAYOUTS, json=BODY, headers=headers)
        assert first.status_code == 201
        await bank.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        assert await pg_store.purge() == 1
        assert (await c.post(PAYOUTS, json=BODY, headers=headers)).status_code == 500
        retry = await c.post(PAYOUTS, json=BODY, headers=headers)
    life1, life2 = (ctx.downstream_key for ctx in probe.contexts)
    assert life1 != life2
    assert await downstream_rows(bank) == 2, "the second life's transfer is its own"
    assert retry.status_code == 201
    assert retry.json() == {"dkey": life2, "amount": 100, "reconciled": True}


async def test_the_memory_store_keeps_the_epoch_across_a_takeover_and_renews_it_on_reclaim() -> (
    None
):
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    key = RecordKey("tenant-a", PAYOUTS_OP, "k1")
    claim = await store.claim_lease(key, b"f", retention_seconds=10, lease_seconds=5)
    assert isinstance(claim, Claimed)
    assert claim.epoch is not None
    now[0] += 6  # the lease lapsed: a takeover is the same life
    generation = await store.takeover(key, claim.generation, State.PENDING, 5)
    assert generation is not None
    record = await store.get(key)
    assert record is not None
    assert record.epoch == claim.epoch
    done = Settlement(State.SUCCEEDED, StoredResponse(201, [], b""))
    assert await store.settle(key, generation, State.PENDING, done)
    now[0] += 11  # retention over: a new life
    again = await store.claim_lease(key, b"f", retention_seconds=10, lease_seconds=5)
    assert isinstance(again, Claimed)
    assert again.epoch is not None
    assert again.epoch != claim.epoch


# -- item 3: a consumed one-time token never executes again -----------------------------------


def token_app(store: Any, mode: Mode) -> Any:
    return build_app(
        store, policies={CREDITS_OP: Policy(require_token=True, mode=mode, wait_seconds=5)}
    )


async def expire_and_purge(store: PostgresStore, pool: Any, *, tokens: bool) -> None:
    await pool.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
    if tokens:
        await pool.execute("UPDATE idem_tokens SET expires_at = now() - interval '1 second'")
    await store.purge()
    assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 0


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_an_intent_whose_token_was_used_is_not_issued_it_again(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    """Issue, consume (201), token and record expire, purge, issue again: refused. It used to
    renew the same token, and the handler ran a second time."""
    issuer = TokenIssuer(pg_store, secret=SECRET, ttl_seconds=600)
    token = (await issuer.issue("tenant-a", CREDITS_OP, intent_id="order-1")).token
    app = token_app(pg_store, mode)
    headers = {"idempotency-key": token}
    async with client(app) as c:
        assert (await c.post(CREDITS_URL, json={"amount": 5}, headers=headers)).status_code == 201
        # While it is live, asking again returns it: a retry with it gets the stored outcome.
        assert (await issuer.issue("tenant-a", CREDITS_OP, intent_id="order-1")).token == token
        await expire_and_purge(pg_store, pool, tokens=True)
        assert await pool.fetchval("SELECT count(*) FROM idem_tokens") == 1, "the tombstone"
        with pytest.raises(TokenConflict, match="already used"):
            await issuer.issue("tenant-a", CREDITS_OP, intent_id="order-1")
        again = await c.post(CREDITS_URL, json={"amount": 5}, headers=headers)
    assert again.status_code == 400
    assert again.json()["type"] == "urn:idem-middleware:problem:token-invalid"
    assert app.state.probe.calls == 1
    if mode is Mode.TRANSACTIONAL:  # (the lease-mode handler writes no ledger row)
        assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 1


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_token_that_outlives_its_record_does_not_run_again(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    issuer = TokenIssuer(pg_store, secret=SECRET, ttl_seconds=3600)
    token = (await issuer.issue("tenant-a", CREDITS_OP)).token
    app = token_app(pg_store, mode)
    headers = {"idempotency-key": token}
    async with client(app) as c:
        assert (await c.post(CREDITS_URL, json={"amount": 5}, headers=headers)).status_code == 201
        # The record's retention is over (not yet purged, then purged); the token is still live.
        await pool.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        expired = await c.post(CREDITS_URL, json={"amount": 5}, headers=headers)
        await expire_and_purge(pg_store, pool, tokens=False)
        purged = await c.post(CREDITS_URL, json={"amount": 5}, headers=headers)
    for r in (expired, purged):
        assert r.status_code == 400, r.text
        assert "already used" in r.json()["detail"]
    assert app.state.probe.calls == 1
    if mode is Mode.TRANSACTIONAL:  # (the lease-mode handler writes no ledger row)
        assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 1


async def test_a_released_lease_claim_gives_its_token_back() -> None:
    """A request that did nothing (released: "fix and retry") leaves its token unused; the
    memory twin too."""
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    token = "it_token"
    store.add_token("tenant-a", token_hash(token), PAYOUTS_OP, ttl_seconds=60)
    key = RecordKey("tenant-a", PAYOUTS_OP, token)
    options: dict[str, Any] = {"retention_seconds": 10, "lease_seconds": 5}
    claim = await store.claim_lease(key, b"f", token_hash=token_hash(token), **options)
    assert isinstance(claim, Claimed)
    assert await store.release(key, claim.generation)
    again = await store.claim_lease(key, b"f", token_hash=token_hash(token), **options)
    assert isinstance(again, Claimed)
    done = Settlement(State.SUCCEEDED, StoredResponse(201, [], b""))
    assert await store.settle(key, again.generation, State.PENDING, done)
    now[0] += 11
    await store.purge()
    refused = await store.claim_lease(key, b"f", token_hash=token_hash(token), **options)
    # Refused, with its reason, by the claim itself.
    assert isinstance(refused, TokenRefused)
    assert "already used" in refused.reason


# -- item 4: an event delivered on its last attempt is sent, not parked -------------------------


async def test_a_delivery_on_the_last_attempt_wins_over_the_publisher_that_parked_it(
    pool: Any,
) -> None:
    """P1 reserves the event at its last attempt and stalls past its reservation; P2 parks it;
    P1's send succeeds. Marking it sent used to violate idem_outbox_done_check and crash P1's
    batch, leaving a delivered event parked."""
    await ob.add(pool, "payout.sent", {"n": 1}, event_id="e1")
    entered, release = asyncio.Event(), asyncio.Event()

    async def stalled(event: ob.OutboxEvent) -> bool:
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return True

    async def unused(event: ob.OutboxEvent) -> bool:
        raise AssertionError("P2 must not send a parked event")

    options: dict[str, Any] = {"max_attempts": 1, "send_timeout_seconds": 30}
    p1 = ob.Publisher(pool, stalled, **options)
    p2 = ob.Publisher(pool, unused, **options)
    first = asyncio.ensure_future(p1.publish_batch())
    try:
        await asyncio.wait_for(entered.wait(), BOUND)
        # P1's reservation lapses (as if it had been paused past it).
        await pool.execute("UPDATE idem_outbox SET next_attempt_at = now()")
        assert (await p2.publish_batch()).parked == 1
        release.set()
        report = await asyncio.wait_for(first, BOUND)
    finally:
        release.set()
        if not first.done():
            first.cancel()
    assert report.sent == 1
    row = await pool.fetchrow("SELECT sent_at, parked_at, last_error FROM idem_outbox")
    assert row["sent_at"] is not None
    assert row["parked_at"] is None
    assert row["last_error"] is None


async def test_one_refused_mark_does_not_end_the_batch(pool: Any) -> None:
    await pool.execute(
        """
        CREATE FUNCTION test_refuse_mark() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.event_id = 'bad' AND NEW.sent_at IS NOT NULL THEN
                RAISE EXCEPTION 'refused by the test';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER test_refuse_mark BEFORE UPDATE ON idem_outbox
            FOR EACH ROW EXECUTE FUNCTION test_refuse_mark();
        """
    )
    try:
        await ob.add(pool, "t", {}, event_id="bad")
        await ob.add(pool, "t", {}, event_id="good")
        sent: list[str] = []

        async def sender(event: ob.OutboxEvent) -> bool:
            sent.append(event.event_id)
            return True

        report = await ob.Publisher(pool, sender).publish_batch()
    finally:
        await pool.execute(
            "DROP TRIGGER IF EXISTS test_refuse_mark ON idem_outbox;"
            "DROP FUNCTION IF EXISTS test_refuse_mark()"
        )
    assert sent == ["bad", "good"]
    assert report.sent == 1
    rows = dict(await pool.fetch("SELECT event_id, sent_at IS NOT NULL FROM idem_outbox"))
    assert rows == {"bad": False, "good": True}


# -- item 5: a token claim that met a claim released meanwhile claims again --------------------


class _ReleaseBeforeGet:
    """A real connection; before the claim's first `get`, the test's hook runs (the concurrent
    claim releases its record), so the claim finds the record gone."""

    def __init__(self, conn: Any, hook: Any) -> None:
        self._conn = conn
        self._hook = hook

    async def fetch(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._conn.fetch(query, *args, **kw)

    async def fetchrow(self, query: str, *args: Any, **kw: Any) -> Any:
        if query == _Q["get"] and self._hook is not None:
            hook, self._hook = self._hook, None
            await hook()
        return await self._conn.fetchrow(query, *args, **kw)


async def test_a_token_claim_that_met_a_released_claim_claims_again(
    pg_store: PostgresStore, pool: Any, db_dsn: str
) -> None:
    """A's claim of token T is uncommitted; B's claim of T waits on it; A commits, so B's INSERT
    does nothing and its snapshot shows no row; A's request then answers 422 and releases the
    record. B used to answer token-invalid for a valid, unused token."""
    issuer = TokenIssuer(pg_store, secret=SECRET)
    token = (await issuer.issue("tenant-a", PAYOUTS_OP)).token
    key = RecordKey("tenant-a", PAYOUTS_OP, token)
    args = ("tenant-a", PAYOUTS_OP, token, b"f", "lease", 60.0, 30.0)
    a = await asyncpg.connect(db_dsn)
    b = await asyncpg.connect(db_dsn)
    try:
        tx = a.transaction()
        await tx.start()
        rows = await a.fetch(_Q["claim"], *args, token_hash(token), None)  # (no claim lock)
        assert rows[0]["claimed"]
        generation_a = rows[0]["generation"]

        async def a_releases() -> None:
            assert await pg_store.release(key, generation_a)

        executor = _ReleaseBeforeGet(b, a_releases)
        claim_b = asyncio.ensure_future(_claim(executor, key, args, token_hash(token), None))

        async def b_waits() -> bool:
            return bool(
                await pool.fetchval(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                    b.get_server_pid(),
                )
            )

        await until(b_waits, "B's claim to wait on A's")
        await tx.commit()
        claim = await asyncio.wait_for(claim_b, BOUND)
    finally:
        await a.close()
        await b.close()
    assert isinstance(claim, Claimed), "a valid, unused token was refused"
    record = await pool.fetchrow("SELECT generation, state FROM idem_requests")
    assert record["generation"] == claim.generation
    assert record["state"] == "pending"
    assert await pool.fetchval("SELECT consumed_at IS NOT NULL FROM idem_tokens")


# -- item 6: a LISTEN connection that never answers delays no waiter ---------------------------


class BlackHole:
    """A loopback TCP server that accepts connections and never answers, until `release()` (or
    BOUND * 3 seconds), then closes them. `released_first` records whether it was released
    before `answered` was set."""

    def __init__(self) -> None:
        self.accepted = asyncio.Event()
        self.answered = asyncio.Event()
        self._release = asyncio.Event()
        self.released_first: bool | None = None
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._release.wait(), BOUND * 3)
        if self.released_first is None:
            self.released_first = not self.answered.is_set()
        writer.close()

    def release(self) -> None:
        self._release.set()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        try:
            yield self.server.sockets[0].getsockname()[1]
        finally:
            self.release()
            self.server.close()
            await self.server.wait_closed()


async def test_duplicates_are_answered_while_the_listen_connection_hangs(
    pool: Any, bank: asyncpg.Pool[Any]
) -> None:
    """The LISTEN connection's server accepts and never answers. The duplicates (wait 1 s) are
    answered 409 without waiting for that connection attempt: before the test lets it go. They
    used to wait for asyncpg's 60 s connect timeout, one after the other behind a lock."""
    hole = BlackHole()
    async with hole.serving() as port:
        store = PostgresStore(pool=pool, listen_dsn=f"postgresql://nobody@127.0.0.1:{port}/none")
        async with store:
            app = build_lease_app(store, bank, LEASE_POLICY.replace(wait_seconds=1.0))
            gate = asyncio.Event()
            app.state.probe.steps = [Step(gate=gate)]
            async with client(app) as c:
                headers = {"idempotency-key": "k1"}
                original = asyncio.ensure_future(c.post(PAYOUTS, json=BODY, headers=headers))
                try:
                    await asyncio.wait_for(app.state.probe.entered.wait(), BOUND)
                    duplicates = await _answered(c, headers, hole)
                finally:
                    hole.release()
                    gate.set()
                    done = await asyncio.wait_for(original, BOUND)
    assert hole.accepted.is_set(), "the store tried to LISTEN through the black hole"
    assert hole.released_first is False, "a duplicate waited for the LISTEN connection"
    for r in duplicates:
        assert_problem(r, 409, "request-in-flight")
    assert done.status_code == 201


async def _answered(c: httpx.AsyncClient, headers: dict[str, str], hole: BlackHole) -> Any:
    async def duplicate() -> httpx.Response:
        return await c.post(PAYOUTS, json=BODY, headers=headers)

    duplicates = await asyncio.gather(duplicate(), duplicate())
    hole.answered.set()
    return duplicates
