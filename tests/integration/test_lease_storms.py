"""Lease mode's recovery paths meeting each other on one key: a reconciler's verdict racing
another reconciler (a duplicate's, or `idem-middleware reconcile`'s), a takeover, an operator's
move, and storms of duplicates of many keys whose leases lapse at once under a tenant cap.

The route is tests/apps/lease.py's `POST /payouts` (its "bank" deduplicates by downstream key).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import asyncpg
import httpx
import pytest

from idem_middleware import PostgresStore, RecordKey, ops
from idem_middleware.errors import ResolveError
from idem_middleware.fence import Verdict, run_reconciler
from idem_middleware.ops import Resolution, reconcile_unknown
from idem_middleware.reconcile import (
    Happened,
    NotHappened,
    ReconcileContext,
    Reconciliation,
    StillUnknown,
)
from idem_middleware.store import Claimed
from idem_middleware.store.base import Settlement, State, StoredResponse
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    LeaseProbe,
    Step,
    assert_problem,
    build_lease_app,
    client,
    downstream_reconciler,
    downstream_rows,
    idle_in_transaction,
    reset_downstream,
    wait_for_waiters,
)

BODY = {"account": "acc-1", "amount": 100}
OPERATION = f"POST {PAYOUTS}"


def rkey(idem_key: str = "k1") -> RecordKey:
    return RecordKey("tenant-a", OPERATION, idem_key)


@pytest.fixture
async def bank(pool: asyncpg.Pool[Any]) -> AsyncIterator[asyncpg.Pool[Any]]:
    await reset_downstream(pool)
    yield pool
    assert await idle_in_transaction(pool) == 0, "a transaction was left open"


def post(c: httpx.AsyncClient, idem_key: str = "k1") -> Awaitable[httpx.Response]:
    return c.post(PAYOUTS, json=BODY, headers={"idempotency-key": idem_key})


async def record(pool: asyncpg.Pool[Any], idem_key: str = "k1") -> asyncpg.Record:
    row = await pool.fetchrow(
        "SELECT state, generation FROM idem_requests WHERE idem_key = $1", idem_key
    )
    assert row is not None
    return row


async def test_a_not_happened_takeover_waits_no_longer_than_the_clients_wait_for_another_reconciler(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """Another reconciler (an operator's `reconcile`, or a duplicate elsewhere) holds the unknown
    record's fence while it asks the bank. A retry whose own reconciler says "did not happen"
    must take the record over, which needs that lock: it waits at most what is left of its
    `wait_seconds`, answers 409 request-in-flight, and runs nothing (it waited for as long as
    the other reconciler ran, however long). It waits in the process, trying the takeover again,
    not on the row inside PostgreSQL with a pooled connection held."""
    policy = LEASE_POLICY.replace(
        wait_seconds=0.3,
        reconcile_timeout_seconds=4 * BOUND,
        reconciler=downstream_reconciler(bank),
    )
    app = build_lease_app(pg_store, bank, policy)
    probe: LeaseProbe = app.state.probe
    probe.steps = [Step(fail="before")]  # nothing reached the bank: the record is unknown
    gate = asyncio.Event()
    holding = asyncio.Event()

    async def slow_reconciler(rc: ReconcileContext) -> Reconciliation:
        await rc.fenced_connection()
        holding.set()
        await gate.wait()
        return StillUnknown("the bank has not answered")

    async with client(app) as c:
        assert (await post(c)).status_code == 500
        unknown = await record(bank)
        assert unknown["state"] == "unknown"
        other = asyncio.ensure_future(
            run_reconciler(
                pg_store, rkey(), unknown["generation"], slow_reconciler, seconds=4 * BOUND
            )
        )
        try:
            await asyncio.wait_for(holding.wait(), BOUND)
            retry = asyncio.ensure_future(post(c))
            try:
                answered = await asyncio.wait_for(asyncio.shield(retry), BOUND)
            finally:
                gate.set()
                await asyncio.wait_for(retry, BOUND)
        finally:
            gate.set()
            result = await asyncio.wait_for(other, BOUND)
        assert_problem(answered, 409, "request-in-flight")
        assert result.verdict is Verdict.STILL_UNKNOWN
        assert probe.calls == 1
        # The fence is gone: the next retry's reconciler takes the record over and runs it.
        again = await post(c)
    assert again.status_code == 201, again.text
    assert probe.calls == 2
    assert await downstream_rows(bank) == 1


async def test_a_retrys_reconciler_meeting_another_fence_is_in_flight_within_the_wait(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """Another session holds the unknown record's fence (another reconciler asking the bank). A
    retry whose reconciler opens its fenced connection (the documented shape) waited there for
    the reconciler's whole bound, then answered 409 outcome-unknown ("asking failed"), although
    the record was being asked about. It now waits no longer than its own `wait_seconds` and
    answers 409 request-in-flight, the record untouched."""
    policy = LEASE_POLICY.replace(
        wait_seconds=0.3, reconcile_timeout_seconds=4 * BOUND, reconciler=_fenced_happened
    )
    app = build_lease_app(pg_store, bank, policy)
    probe: LeaseProbe = app.state.probe
    probe.steps = [Step(fail="before")]  # nothing reached the bank: the record is unknown
    async with client(app) as c:
        assert (await post(c)).status_code == 500
        unknown = await record(bank)
        assert unknown["state"] == "unknown"
        async with pg_store.fenced(rkey(), unknown["generation"], State.UNKNOWN):
            answered = await asyncio.wait_for(post(c), BOUND)
        assert_problem(answered, 409, "request-in-flight")
        assert tuple(await record(bank)) == ("unknown", unknown["generation"])
        settled = await post(c)  # (the fence gone: the reconciler settles it, and it replays)
    assert settled.status_code == 201, settled.text
    assert probe.calls == 1


async def test_a_retry_meeting_another_fence_asks_its_reconciler_again_only_with_the_fence(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """Another session holds the unknown record's fence. A retry's reconciler asked the
    downstream system, found the fence held, and was asked again on each poll of the retry's
    wait (every retry of a storm calling the bank a dozen times while one reconciler worked).
    After the first HELD, the retry opens the fence before asking again: while it is held the
    reconciler is not called; once it is free, one call settles the record and the retry
    replays it."""
    calls: list[int] = []
    asked = asyncio.Event()

    async def counted(rc: ReconcileContext) -> Reconciliation:
        calls.append(rc.generation)
        asked.set()
        return await _fenced_happened(rc)

    policy = LEASE_POLICY.replace(
        wait_seconds=4 * BOUND, reconcile_timeout_seconds=4 * BOUND, reconciler=counted
    )
    app = build_lease_app(pg_store, bank, policy)
    probe: LeaseProbe = app.state.probe
    probe.steps = [Step(fail="before")]  # nothing reached the bank: the record is unknown
    async with client(app) as c:
        assert (await post(c)).status_code == 500
        unknown = await record(bank)
        async with pg_store.fenced(rkey(), unknown["generation"], State.UNKNOWN):
            retry = asyncio.ensure_future(post(c))
            await asyncio.wait_for(asked.wait(), BOUND)
            # Held past the retry's first polls (0.05 s, doubling): each one asked again.
            await asyncio.sleep(0.5)
            assert len(calls) == 1, "the reconciler was asked again while the fence was held"
        answered = await asyncio.wait_for(retry, 4 * BOUND)
    assert answered.status_code == 201, answered.text
    assert len(calls) == 2
    assert probe.calls == 1
    assert tuple(await record(bank)) == ("succeeded", unknown["generation"])


# -- `idem-middleware reconcile` passes over a record another session holds ---------------------


async def _happened(rc: ReconcileContext) -> Reconciliation:
    return Happened(201, b"{}")


async def _not_happened(rc: ReconcileContext) -> Reconciliation:
    return NotHappened()


async def _claimed(store: PostgresStore, key: RecordKey, lease_seconds: float = 30.0) -> int:
    claim = await store.claim_lease(key, b"f", retention_seconds=60, lease_seconds=lease_seconds)
    assert isinstance(claim, Claimed)
    return claim.generation


async def _unknown(store: PostgresStore, key: RecordKey) -> int:
    generation = await _claimed(store, key)
    assert await store.settle(key, generation, State.PENDING, Settlement(State.UNKNOWN))
    return generation


@pytest.mark.parametrize("held", ["executor past its lease", "another reconciler"])
async def test_reconcile_passes_over_a_record_another_session_holds(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], held: str
) -> None:
    """An executor holding its fenced transaction past its lease (or paused while it holds it),
    or another reconciler, holds the record's row: the batch waited for it (for good, if that
    process was stopped), and settled nothing else meanwhile. It passes it over now, counts it
    `held`, settles the others, and a later run takes the record up again."""
    busy = rkey("busy")
    if held == "executor past its lease":
        generation = await _claimed(pg_store, busy, lease_seconds=0.05)
        expected, reconciler = State.PENDING, _happened

        async def lapsed() -> bool:
            summary = await pg_store.describe(busy)
            return summary is not None and bool(summary.lease_expired)

        for _ in range(int(BOUND / 0.01)):
            if await lapsed():
                break
            await asyncio.sleep(0.01)
    else:
        generation = await _unknown(pg_store, busy)
        expected, reconciler = State.UNKNOWN, _not_happened
    await _unknown(pg_store, rkey("free"))
    async with pg_store.fenced(busy, generation, expected):
        report = await asyncio.wait_for(
            reconcile_unknown(pg_store, {OPERATION: reconciler}, seconds=BOUND), BOUND
        )
        assert report.held == 1
        assert report.verdicts == {"settled" if reconciler is _happened else "not-happened": 1}
        record_of_busy = await pg_store.get(busy)
        assert record_of_busy is not None
        assert (record_of_busy.state, record_of_busy.generation) == (expected, generation)
    again = await asyncio.wait_for(
        reconcile_unknown(pg_store, {OPERATION: reconciler}, seconds=BOUND), BOUND
    )
    assert again.held == 0
    settled = await pg_store.get(busy)
    assert settled is not None
    if reconciler is _happened:
        assert again.expired_leases == 1
        assert settled.state is State.SUCCEEDED
    else:
        assert settled.retry_allowed


async def _fenced_happened(rc: ReconcileContext) -> Reconciliation:
    conn = await rc.fenced_connection()  # (the documented shape: the debit commits with it)
    await conn.execute("SELECT 1")
    return Happened(201, b"{}")


async def test_a_reconcilers_fence_on_a_record_another_session_holds_is_passed_over(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: the held record was passed over only when the batch's own moves met
    the lock. A reconciler that opens its fenced connection (the documented shape) waited there
    for the whole `--seconds` (10 s by default) for each record another session held (another
    reconciler asking the bank, a process paused holding one), then counted it `failed` with a
    'reconciler failed' warning. Its fence now waits as the batch's moves do (at most a second,
    or `--seconds` if less): the record is counted `held`, nothing is logged as failed, and a
    later run settles it."""
    busy = rkey("busy")
    generation = await _unknown(pg_store, busy)
    await _unknown(pg_store, rkey("free"))
    seconds = BOUND / 2  # (the reconciler's bound, shorter than the test's)
    async with pg_store.fenced(busy, generation, State.UNKNOWN):
        report = await asyncio.wait_for(
            reconcile_unknown(pg_store, {OPERATION: _fenced_happened}, seconds=seconds), BOUND
        )
        busy_now = await pg_store.get(busy)
    assert (report.held, report.verdicts) == (1, {"settled": 1})
    assert not [r for r in caplog.records if r.getMessage() == "reconciler failed"]
    # (Nor the pool's "Resetting connection with an active transaction": the fence's connection,
    # cancelled in its lock wait, is terminated rather than reset by the pool.)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert busy_now is not None
    assert (busy_now.state, busy_now.generation) == (State.UNKNOWN, generation)
    again = await asyncio.wait_for(
        reconcile_unknown(pg_store, {OPERATION: _fenced_happened}, seconds=seconds), BOUND
    )
    assert (again.held, again.verdicts) == (0, {"settled": 1})


@pytest.mark.parametrize("move", ["resolve", "reopen"])
async def test_an_operators_move_on_a_record_a_reconciler_holds_gives_up_and_says_so(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch, move: str
) -> None:
    """A reconciler's fenced transaction holds the record's row while it asks the bank (for good
    if its process is paused): `resolve` and `reopen` waited for it with no bound. They now give
    up after a while with a ResolveError saying why, and the record is as it was."""
    monkeypatch.setattr(ops, "_BUSY_WAIT", 0.2)
    key = rkey("held")
    generation = await _unknown(pg_store, key)
    if move == "reopen":
        response = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}")
        await ops.resolve(pg_store, key, Resolution.SUCCEEDED, note="n", response=response)
        state = State.SUCCEEDED
        resolved = await pg_store.get(key)  # (a resolution takes a generation of its own)
        assert resolved is not None
        generation = resolved.generation
    else:
        state = State.UNKNOWN
    async with pg_store.fenced(key, generation, state):
        moved = (
            ops.resolve(pg_store, key, Resolution.RETRY, note="by hand")
            if move == "resolve"
            else ops.reopen(pg_store, key, note="by hand")
        )
        with pytest.raises(ResolveError, match="another session held this record"):
            await asyncio.wait_for(moved, BOUND)
    after = await pg_store.get(key)
    assert after is not None
    assert (after.state, after.generation) == (state, generation)


async def test_lapsed_leases_left_for_a_takeover_never_keep_others_from_their_turn(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """A takeover route's lapsed leases are left pending for the client's retry; they are the
    oldest here, as many as the batch's `limit`. The batch looked only at the `limit` oldest
    lapsed leases, so it turned none unknown and reconciled nothing; the window now reaches
    past those it passes over."""
    takeover_op = "POST /takeover"
    for i in range(3):
        await _claimed(pg_store, RecordKey("tenant-a", takeover_op, f"old-{i}"), 0.05)
    await _claimed(pg_store, rkey("new"), 0.05)
    for _ in range(int(BOUND / 0.01)):
        summary = await pg_store.describe(rkey("new"))
        if summary is not None and summary.lease_expired:
            break
        await asyncio.sleep(0.01)
    report = await asyncio.wait_for(
        reconcile_unknown(
            pg_store, {OPERATION: _happened}, limit=2, takeover={takeover_op}, seconds=BOUND
        ),
        BOUND,
    )
    assert (report.expired_leases, report.verdicts) == (1, {"settled": 1})
    settled = await pg_store.get(rkey("new"))
    assert settled is not None
    assert settled.state is State.SUCCEEDED
    for i in range(3):
        left = await pg_store.get(RecordKey("tenant-a", takeover_op, f"old-{i}"))
        assert left is not None
        assert left.state is State.PENDING


async def test_a_not_happened_takeover_waiting_for_another_reconciler_is_a_counted_waiter(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """A retry reconciled "did not happen" whose takeover finds another reconciler's fence: it
    slept in a loop of its own, holding its tenant slot, uncounted by `max_waiters` and deaf to
    its client leaving. It now waits in the duplicate's loop (a counted waiter), and takes the
    record over (the reconciler not asked again) once the fence is gone."""
    policy = LEASE_POLICY.replace(
        wait_seconds=4 * BOUND,
        reconcile_timeout_seconds=4 * BOUND,
        reconciler=downstream_reconciler(bank),
    )
    app = build_lease_app(pg_store, bank, policy)
    probe: LeaseProbe = app.state.probe
    probe.steps = [Step(fail="before")]
    gate, holding = asyncio.Event(), asyncio.Event()

    async def slow_reconciler(rc: ReconcileContext) -> Reconciliation:
        await rc.fenced_connection()
        holding.set()
        await gate.wait()
        return StillUnknown("the bank has not answered")

    async with client(app) as c:
        assert (await post(c)).status_code == 500
        unknown = await record(bank)
        other = asyncio.ensure_future(
            run_reconciler(
                pg_store, rkey(), unknown["generation"], slow_reconciler, seconds=4 * BOUND
            )
        )
        try:
            await asyncio.wait_for(holding.wait(), BOUND)
            retry = asyncio.ensure_future(post(c))
            try:
                await wait_for_waiters(app, 1)
            finally:
                gate.set()
                answered = await asyncio.wait_for(retry, 4 * BOUND)
        finally:
            gate.set()
            await asyncio.wait_for(other, BOUND)
    assert answered.status_code == 201, answered.text
    assert probe.calls == 2
