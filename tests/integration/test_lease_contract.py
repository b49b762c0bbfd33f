"""The store contract of lease operations: claim, heartbeat, lease expiry, takeover, settle,
release, allow-retry, the fenced session, watches and listing, on every store the contract
harness offers (tests/contract.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from idem_middleware import RecordKey, StaleGeneration, State
from idem_middleware.store import ClaimBusy, Claimed, Existing
from idem_middleware.store.base import Settlement
from tests.apps import BOUND, PAYOUTS, trail
from tests.apps.concurrency import until
from tests.contract import FP, RESPONSE, Harness, PgHarness

pytestmark = pytest.mark.db_routes("pgbouncer", "partitioned")

OPERATION = f"POST {PAYOUTS}"
LEDGER_INSERT = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, $2, $3)"
DONE = Settlement(State.SUCCEEDED, RESPONSE)


def rkey(idem_key: str = "k1", tenant: str = "tenant-a") -> RecordKey:
    return RecordKey(tenant, OPERATION, idem_key)


async def claim_lease(harness: Harness, name: str = "k1", lease: float = 30.0) -> int:
    result = await harness.store.claim_lease(
        rkey(name), FP, retention_seconds=3600.0, lease_seconds=lease
    )
    assert isinstance(result, Claimed)
    return result.generation


async def test_contract_every_move_of_a_record_appends_to_its_audit_trail(harness: Harness) -> None:
    """The executor's, a reconciler's and the lease's own moves keep what was written before (an
    operator's note above all): each appends its line."""
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    assert await store.settle(k, g1, State.PENDING, Settlement(State.UNKNOWN, note="lost"))
    assert await store.allow_retry(k, g1, "reconciled: not happened")
    released = await store.describe(k)
    assert released is not None
    g2 = await store.takeover(k, released.generation, State.PENDING, 30.0)  # the client's retry
    assert g2 is not None
    await harness.lapse(k)
    assert await store.expire_lease(k, g2)
    assert await store.settle(k, g2, State.UNKNOWN, Settlement(State.UNKNOWN))  # (no note)
    summary = await store.describe(k)
    assert summary is not None
    assert trail(summary.note) == ["lost", "reconciled: not happened", "lease expired"]


async def assert_refused_everywhere(harness: Harness, k: RecordKey, stale: int) -> None:
    """Every operation under a generation that is no longer current is refused."""
    store = harness.store
    assert not await store.heartbeat(k, stale, 30.0)
    assert not await store.expire_lease(k, stale)
    for expected in (State.PENDING, State.UNKNOWN):
        assert await store.takeover(k, stale, expected, 30.0) is None
        assert not await store.settle(k, stale, expected, DONE)
        with pytest.raises(StaleGeneration):
            async with store.fenced(k, stale, expected):
                pass
    assert not await store.release(k, stale)
    assert not await store.allow_retry(k, stale, "no")


async def test_contract_claim_and_heartbeat(harness: Harness) -> None:
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    for fingerprint in (FP, b"\x02" * 32):
        other = await store.claim_lease(
            k, fingerprint, retention_seconds=3600.0, lease_seconds=30.0
        )
        assert isinstance(other, Existing)
        assert other.record.generation == g1
        assert other.record.state is State.PENDING
        assert other.record.fingerprint == FP
        assert not other.record.lease_expired
        assert not other.record.retry_allowed
    assert await store.heartbeat(k, g1, 30.0)
    assert not await store.heartbeat(k, g1 + 1000, 30.0)
    assert not await store.heartbeat(rkey("absent"), g1, 30.0)
    # A live lease can neither be expired nor taken over.
    assert not await store.expire_lease(k, g1)
    assert await store.takeover(k, g1, State.PENDING, 30.0) is None
    # A lapsed lease that nobody acted on is renewed by a late heartbeat.
    await harness.lapse(k)
    record = await store.get(k)
    assert record is not None
    assert record.lease_expired
    assert await store.heartbeat(k, g1, 30.0)
    record = await store.get(k)
    assert record is not None
    assert not record.lease_expired
    # Once settled, nothing renews it.
    assert await store.settle(k, g1, State.PENDING, DONE)
    assert not await store.heartbeat(k, g1, 30.0)


async def test_contract_a_renewal_never_shortens_the_lease(harness: Harness) -> None:
    """A renewal whose statement was held up (a table lock) and landed after a later one set
    the lease's end from its own, earlier, start: shorter than the later renewal's, which the
    execution counts on, so a duplicate could take the record over while it still ran."""
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    assert await store.heartbeat(k, g1, 3600.0)
    later = await store.describe(k)
    assert later is not None
    assert await store.heartbeat(k, g1, 30.0)  # (as if sent long before the one above)
    after = await store.describe(k)
    assert after is not None
    assert after.lease_expires_at == later.lease_expires_at


async def test_contract_a_renewal_never_waits_on_the_generations_own_fenced_session(
    harness: Harness,
) -> None:
    """While the executor's fenced session holds the record's row lock (its handler keeps it
    open across a slow downstream call, past its lease), a renewal answers at once: alive, the
    lease left as it is (nobody can take the record over meanwhile). It waited on that lock for
    as long as the session lasted, holding a second connection, and renewed nothing. Once the
    session ends without settling, the next renewal renews."""
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    await harness.lapse(k)
    async with store.fenced(k, g1):
        assert await asyncio.wait_for(store.heartbeat(k, g1, 30.0), BOUND)
        assert not await asyncio.wait_for(store.heartbeat(k, g1 + 1000, 30.0), BOUND)
        record = await store.get(k)
        assert record is not None
        assert record.lease_expired  # left as it is: the lock holds the record
    assert await store.heartbeat(k, g1, 30.0)  # the session ended: renewed now
    record = await store.get(k)
    assert record is not None
    assert not record.lease_expired


async def test_contract_expire_lease_only_after_the_lease_lapsed(harness: Harness) -> None:
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    assert not await store.expire_lease(k, g1)
    await harness.lapse(k)
    assert not await store.expire_lease(k, g1 + 1000)
    assert await store.expire_lease(k, g1)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.UNKNOWN
    assert record.generation == g1
    assert record.response is None
    assert not record.lease_expired
    assert not await store.expire_lease(k, g1)  # only once
    assert not await store.heartbeat(k, g1, 30.0)
    assert not await store.settle(k, g1, State.PENDING, DONE)
    (summary,) = await store.list_records(states=[State.UNKNOWN])
    assert trail(summary.note) == ["lease expired"]
    # A finished record has no lease to expire.
    g2 = await claim_lease(harness, "k2")
    assert await store.settle(rkey("k2"), g2, State.PENDING, DONE)
    assert not await store.expire_lease(rkey("k2"), g2)


async def test_contract_expire_lease_never_waits_for_a_fenced_session(harness: Harness) -> None:
    """An executor's fenced session holds its record past its lease: expiring the lease is
    ClaimBusy at once (the caller waits without a connection, or a batch passes it over).
    Found by probing: PostgreSQL's expire_lease waited for the row inside the database, its
    pooled connection held, for up to the duplicate's wait; in a storm of duplicates on a small
    pool those waits took every connection and the rest were answered 503."""
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    await harness.lapse(k)
    async with store.fenced(k, g1) as session:
        for _ in range(2):  # (and again: a busy expiry changed nothing)
            with pytest.raises(ClaimBusy):
                await asyncio.wait_for(store.expire_lease(k, g1), BOUND)
        assert await session.settle(DONE)
    assert not await asyncio.wait_for(store.expire_lease(k, g1), BOUND)  # (it settled)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.SUCCEEDED


async def test_contract_a_reconcilers_fence_never_waits_for_another(harness: Harness) -> None:
    """An unknown record's fenced session (a reconciler's) while another holds it: ClaimBusy at
    once, not a wait inside the database with a pooled connection held (another reconciler
    asks its downstream system for as long as it takes). An executor's fence is unchanged."""
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    assert await store.settle(k, g1, State.PENDING, Settlement(State.UNKNOWN))
    async with store.fenced(k, g1, State.UNKNOWN):
        other = store.fenced(k, g1, State.UNKNOWN)
        with pytest.raises(ClaimBusy):
            await asyncio.wait_for(other.__aenter__(), BOUND)
    async with asyncio.timeout(BOUND):
        async with store.fenced(k, g1, State.UNKNOWN):
            pass  # (free again)


async def test_contract_takeover_gives_a_larger_generation_and_fences_out_the_old(
    harness: Harness,
) -> None:
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    await harness.lapse(k)
    g2 = await store.takeover(k, g1, State.PENDING, 30.0)
    assert g2 is not None
    assert g2 > g1
    record = await store.get(k)
    assert record is not None
    assert record.state is State.PENDING
    assert record.generation == g2
    assert not record.lease_expired  # the new executor has a fresh lease
    assert await store.takeover(k, g2, State.PENDING, 30.0) is None  # it is live
    await assert_refused_everywhere(harness, k, g1)
    assert await store.heartbeat(k, g2, 30.0)
    assert await store.settle(k, g2, State.PENDING, DONE)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.response == RESPONSE
    assert not record.expired
    assert await store.takeover(k, g2, State.PENDING, 30.0) is None


async def test_contract_settle_is_a_compare_and_set_on_state_and_generation(
    harness: Harness,
) -> None:
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    assert not await store.settle(k, g1, State.UNKNOWN, DONE)  # wrong expected state
    assert not await store.settle(k, g1 + 1000, State.PENDING, DONE)
    assert await store.settle(k, g1, State.PENDING, Settlement(State.UNKNOWN))
    record = await store.get(k)
    assert record is not None
    assert record.state is State.UNKNOWN
    assert record.response is None
    assert not await store.settle(k, g1, State.PENDING, DONE)
    final = Settlement(State.FAILED_FINAL, replace(RESPONSE, status=402), note="reconciled")
    assert await store.settle(k, g1, State.UNKNOWN, final)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.FAILED_FINAL
    assert record.response == replace(RESPONSE, status=402)
    assert record.generation == g1
    assert not await store.settle(k, g1, State.UNKNOWN, DONE)  # only once


async def test_contract_release_deletes_only_a_pending_claim_of_its_generation(
    harness: Harness,
) -> None:
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    assert not await store.release(k, g1 + 1000)
    assert await store.release(k, g1)
    assert await store.get(k) is None
    assert not await store.release(k, g1)
    g2 = await claim_lease(harness)
    assert g2 > g1
    assert await store.settle(k, g2, State.PENDING, Settlement(State.UNKNOWN))
    assert not await store.release(k, g2)  # an unknown outcome is never forgotten
    assert (await store.get(k)) is not None


async def test_contract_allow_retry_only_from_unknown_then_takeover_without_lapse(
    harness: Harness,
) -> None:
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    assert not await store.allow_retry(k, g1, "no")  # pending
    assert await store.settle(k, g1, State.PENDING, Settlement(State.UNKNOWN))
    assert not await store.allow_retry(k, g1 + 1000, "no")
    assert await store.allow_retry(k, g1, "operator: not at the bank")
    record = await store.get(k)
    assert record is not None
    assert record.state is State.PENDING
    assert record.retry_allowed
    assert not record.lease_expired
    g2 = record.generation
    assert g2 > g1
    await assert_refused_everywhere(harness, k, g1)
    assert not await store.allow_retry(k, g2, "no")  # pending again
    assert not await store.expire_lease(k, g2)  # no lease to lapse
    g3 = await store.takeover(k, g2, State.PENDING, 30.0)  # no lapse needed
    assert g3 is not None
    assert g3 > g2
    record = await store.get(k)
    assert record is not None
    assert not record.retry_allowed

    # unknown -> pending directly (a reconciler said "did not happen").
    k2 = rkey("k2")
    g = await claim_lease(harness, "k2")
    assert await store.settle(k2, g, State.PENDING, Settlement(State.UNKNOWN))
    assert await store.takeover(k2, g, State.PENDING, 30.0) is None
    g_new = await store.takeover(k2, g, State.UNKNOWN, 30.0)
    assert g_new is not None
    assert g_new > g
    record = await store.get(k2)
    assert record is not None
    assert record.state is State.PENDING
    assert not record.lease_expired


async def test_contract_a_fenced_session_gives_its_connection_back_however_it_ends(
    harness: Harness,
) -> None:
    """Refused (a stale generation), left by an error, or left after a refused settlement: each
    fenced session returns its connection. Many more sessions than the pool has connections,
    under a deadline, so a leak fails here instead of hanging the next checkout."""
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    stale = g1 - 1

    async def sessions() -> None:
        for _ in range(60):
            with pytest.raises(StaleGeneration):
                async with store.fenced(k, stale):
                    pass
            with pytest.raises(RuntimeError, match="left"):
                async with store.fenced(k, g1):
                    raise RuntimeError("left")

    await asyncio.wait_for(sessions(), 30)
    record = await store.get(k)
    assert record is not None
    assert record.state is State.PENDING  # every session under g1 rolled back
    async with store.fenced(k, g1) as session:
        assert await session.settle(DONE)


async def test_contract_a_fenced_settlement_commits_with_the_writes_or_neither_does(
    harness: Harness,
) -> None:
    """`settle` is the fenced session's last act: it commits the settlement with the writes
    made on the session's connection. A session that ends by an error before it settles
    commits neither."""
    store = harness.store
    k, k2 = rkey(), rkey("k2")
    g1 = await claim_lease(harness)
    async with store.fenced(k, g1) as session:
        if harness.kind == "postgres":
            conn: Any = session.connection
            await conn.execute(LEDGER_INSERT, "tenant-a", "acc-1", 1)
        assert await session.settle(DONE)
        record = await store.get(k)
        assert record is not None
        assert record.state is State.SUCCEEDED, "settled but not committed"
    record = await store.get(k)
    assert record is not None
    assert record.state is State.SUCCEEDED
    with pytest.raises(StaleGeneration):
        async with store.fenced(k, g1):  # settled: no longer pending
            pass

    g2 = await claim_lease(harness, "k2")

    async def fail_before_settling() -> None:
        async with store.fenced(k2, g2) as session:
            if harness.kind == "postgres":
                conn: Any = session.connection
                await conn.execute(LEDGER_INSERT, "tenant-a", "acc-2", 1)
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError, match="handler failed"):
        await fail_before_settling()
    record = await store.get(k2)
    assert record is not None
    assert record.state is State.PENDING, "a rolled-back fenced session settled"
    with pytest.raises(StaleGeneration):
        async with store.fenced(k2, g2, State.UNKNOWN):
            pass
    with pytest.raises(StaleGeneration):
        async with store.fenced(k2, g2 + 1000):
            pass
    if isinstance(harness, PgHarness):
        accounts = await harness.pool.fetch("SELECT account_id FROM test_ledger")
        assert [r["account_id"] for r in accounts] == ["acc-1"]


@pytest.mark.parametrize("settles", [True, False])
async def test_contract_fenced_session_holds_off_a_takeover_until_it_ends(
    harness: Harness, settles: bool
) -> None:
    """A takeover never waits for the record's row: while a fenced session holds it, the
    takeover is ClaimBusy at once (the caller waits without a connection and tries again).
    Found by probing: PostgreSQL's takeover waited for the row inside the database, its pooled
    connection held, for up to the duplicate's wait; in a storm of duplicates on a small pool
    two such waits took every free connection and the rest were answered 503."""
    store = harness.store
    k = rkey()
    g1 = await claim_lease(harness)
    await harness.lapse(k)
    async with store.fenced(k, g1) as session:
        for _ in range(2):  # (and again: a busy takeover changed nothing)
            with pytest.raises(ClaimBusy):
                await asyncio.wait_for(store.takeover(k, g1, State.PENDING, 30.0), BOUND)
        if settles:
            assert await session.settle(DONE)
    new = await asyncio.wait_for(store.takeover(k, g1, State.PENDING, 30.0), BOUND)
    record = await store.get(k)
    assert record is not None
    if settles:
        assert new is None, "a takeover slipped between the fence check and its commit"
        assert record.state is State.SUCCEEDED
        assert record.generation == g1
    else:
        assert new is not None
        assert new > g1
        assert record.generation == new


@pytest.mark.needs_listen
async def test_contract_watch_is_woken_by_settle_release_and_allow_retry(
    harness: Harness,
) -> None:
    store = harness.store
    k, other = rkey(), rkey("other")
    g1 = await claim_lease(harness)

    async def woken_by(action: Callable[[], Awaitable[bool]]) -> None:
        async with store.watch(k) as watch, store.watch(other) as bystander:
            assert not await watch.wait(0.01)
            # (The LISTEN connection is made in the background: on a loaded machine it may not
            # be up yet, and a waiter polls until it is. Woken is what is tested here.)
            await until(lambda: watch.listening)
            assert await action()
            assert await watch.wait(BOUND)
            assert not await bystander.wait(0.05)

    await woken_by(lambda: store.settle(k, g1, State.PENDING, Settlement(State.UNKNOWN)))
    await woken_by(lambda: store.allow_retry(k, g1, "retry"))
    record = await store.get(k)
    assert record is not None
    await woken_by(lambda: store.release(k, record.generation))
    assert await store.get(k) is None


async def test_contract_list_records_by_state_tenant_operation_and_staleness(
    harness: Harness,
) -> None:
    store = harness.store
    g_live = await claim_lease(harness, "live")
    await harness.tick()
    await claim_lease(harness, "lapsed")
    await harness.lapse(rkey("lapsed"))
    await harness.tick()
    g_unknown = await claim_lease(harness, "unknown")
    assert await store.settle(rkey("unknown"), g_unknown, State.PENDING, Settlement(State.UNKNOWN))
    await harness.tick()
    g_retry = await claim_lease(harness, "retry")
    assert await store.settle(rkey("retry"), g_retry, State.PENDING, Settlement(State.UNKNOWN))
    assert await store.allow_retry(rkey("retry"), g_retry, "operator")
    await harness.tick()
    g_done = await claim_lease(harness, "done")
    assert await store.settle(rkey("done"), g_done, State.PENDING, DONE)
    await harness.tick()
    b = await store.claim_lease(
        rkey("b-unknown", tenant="tenant-b"), FP, retention_seconds=60.0, lease_seconds=30.0
    )
    assert await store.settle(
        rkey("b-unknown", tenant="tenant-b"), b.generation, State.PENDING, Settlement(State.UNKNOWN)
    )

    def names(summaries: list[Any]) -> list[str]:
        return [s.key.key for s in summaries]

    unresolved = [State.PENDING, State.UNKNOWN]
    everything = await store.list_records(states=unresolved)
    assert names(everything) == ["live", "lapsed", "unknown", "retry", "b-unknown"]
    by_key = {s.key.key: s for s in everything}
    assert by_key["lapsed"].lease_expired
    assert not by_key["live"].lease_expired
    assert not by_key["retry"].lease_expired
    assert by_key["live"].generation == g_live
    assert by_key["live"].mode == "lease"
    assert trail(by_key["retry"].note) == ["operator"]
    assert by_key["unknown"].response_status is None
    assert names(await store.list_records(states=unresolved, stale_only=True)) == [
        "lapsed",
        "unknown",
        "retry",
        "b-unknown",
    ]
    assert names(await store.list_records(states=unresolved, tenant="tenant-b")) == ["b-unknown"]
    assert names(await store.list_records(states=unresolved, operation="POST /other")) == []
    assert names(await store.list_records(states=unresolved, limit=2)) == ["live", "lapsed"]
    done = await store.list_records(states=[State.SUCCEEDED])
    assert names(done) == ["done"]
    assert done[0].response_status == 201
    assert done[0].expires_at is not None


async def test_contract_stats_full_and_unresolved_only(harness: Harness) -> None:
    """Both stores count alike: every record, or pending and unknown ones alone (what the
    Prometheus gauges are fed from by default), with the pending records whose lease lapsed (not
    one released for a retry: it has no lease) and the oldest of each state."""
    store = harness.store
    await claim_lease(harness, "live", lease=3600.0)  # (live once the clock moves a minute)
    await claim_lease(harness, "lapsed")
    await harness.lapse(rkey("lapsed"))
    g_unknown = await claim_lease(harness, "unknown")
    assert await store.settle(rkey("unknown"), g_unknown, State.PENDING, Settlement(State.UNKNOWN))
    g_retry = await claim_lease(harness, "retry")
    assert await store.settle(rkey("retry"), g_retry, State.PENDING, Settlement(State.UNKNOWN))
    assert await store.allow_retry(rkey("retry"), g_retry, "operator")
    for name in ("done-1", "done-2"):
        assert await store.settle(rkey(name), await claim_lease(harness, name), State.PENDING, DONE)
    await harness.age(60.0)  # (the memory store's clock: its leases age too)

    full = await store.stats()
    assert full.counts == {"pending": 3, "succeeded": 2, "failed_final": 0, "unknown": 1}
    assert full.lapsed_leases == 1
    assert full.oldest_age_seconds["failed_final"] is None
    cheap = await store.stats(unresolved_only=True)
    assert cheap.counts == {"pending": 3, "unknown": 1}
    assert cheap.lapsed_leases == 1
    assert set(cheap.oldest_age_seconds) == {"pending", "unknown"}
    for stats in (full, cheap):
        for state in ("pending", "unknown"):
            age = stats.oldest_age_seconds[state]
            assert age is not None
            assert 60.0 <= age < 120.0, (state, age)
        assert stats.oldest_unresolved_age_seconds == max(
            age for state in ("pending", "unknown") if (age := stats.oldest_age_seconds[state])
        )
