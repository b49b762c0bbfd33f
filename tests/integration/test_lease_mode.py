"""Lease mode on a real PostgreSQL (docs/lease-mode.md), and its store contract on both stores.

The route under test is `POST /payouts` (tests/apps/lease.py): the handler makes a
downstream effect in `test_downstream` (a bank outside our transaction that deduplicates by the
downstream key) and may write `test_ledger` rows on its fenced connection. Each execution is
scripted by a `Step` (fail before/after the effect, hold on a gate, answer a status ...).

The seed article's failure windows each have a named test (`test_seed_*`); "crash after claim"
is in test_lease_process.py, with a real SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from idem_middleware import (
    LeaseExpiry,
    Outcome,
    PostgresStore,
    RecordKey,
    State,
    StoredResponse,
    derive_downstream_key,
)
from idem_middleware.reconcile import (
    Happened,
    NotHappened,
    ReconcileContext,
    Reconciliation,
    StillUnknown,
)
from idem_middleware.store.base import Settlement
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    LeaseProbe,
    Step,
    assert_problem,
    assert_replay_of,
    build_lease_app,
    client,
    count,
    downstream_reconciler,
    downstream_rows,
    idle_in_transaction,
    lock_waiters,
    reset_downstream,
    trail,
    wait_for_waiters,
)

pytestmark = pytest.mark.db_routes("pgbouncer")

BODY = {"account": "acc-1", "amount": 100}
OPERATION = f"POST {PAYOUTS}"
LEDGER_INSERT = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, $2, $3)"


def rkey(idem_key: str = "k1", tenant: str = "tenant-a") -> RecordKey:
    return RecordKey(tenant, OPERATION, idem_key)


async def dkey(pool: asyncpg.Pool[Any], idem_key: str = "k1") -> str:
    """The downstream key of the record's current life (its epoch)."""
    epoch = await pool.fetchval("SELECT epoch FROM idem_requests WHERE idem_key = $1", idem_key)
    assert epoch is not None
    return derive_downstream_key("tenant-a", OPERATION, idem_key, epoch)


#: Requests a test started in the background (see `spawn`).
_SPAWNED: list[asyncio.Task[Any]] = []


def spawn(request: Awaitable[httpx.Response]) -> asyncio.Task[httpx.Response]:
    """Run a request in the background; `bank` cancels it at teardown if the test did not finish
    it (a failed assertion), so no handler stays held on a gate with a connection acquired."""
    task = asyncio.ensure_future(request)
    _SPAWNED.append(task)
    return task


@pytest.fixture
async def bank(pool: asyncpg.Pool[Any]) -> AsyncIterator[asyncpg.Pool[Any]]:
    """The test database's pool, with the downstream tables created and emptied."""
    await reset_downstream(pool)
    _SPAWNED.clear()
    yield pool
    leftovers = [t for t in _SPAWNED if not t.done()]
    _SPAWNED.clear()
    for task in leftovers:
        task.cancel()
    if leftovers:
        await asyncio.wait(leftovers, timeout=BOUND)
    if await idle_in_transaction(pool):
        # A transaction left open (a leaked fenced session) would keep its connection acquired
        # and make the pool's close wait forever: end it here, and fail.
        pool.terminate()
        pytest.fail("a transaction was left open (a leaked fenced session)")


def probe_of(app: Any) -> LeaseProbe:
    probe: LeaseProbe = app.state.probe
    return probe


async def row(pool: asyncpg.Pool[Any], idem_key: str = "k1") -> asyncpg.Record | None:
    """The record as another connection sees it (committed state only)."""
    return await pool.fetchrow(
        "SELECT state, mode, generation, lease_expires_at, created_at, note, response_status,"
        " response_body, lease_expires_at > now() AS lease_live,"
        " lease_expires_at > created_at + interval '0.6 seconds' AS renewed"
        " FROM idem_requests WHERE idem_key = $1",
        idem_key,
    )


async def state_of(pool: asyncpg.Pool[Any], idem_key: str = "k1") -> str | None:
    r = await row(pool, idem_key)
    return None if r is None else str(r["state"])


async def until(predicate: Callable[[], Awaitable[bool]], what: str, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def lease_lapsed(pool: asyncpg.Pool[Any], idem_key: str = "k1") -> None:
    async def lapsed() -> bool:
        r = await row(pool, idem_key)
        return r is not None and not r["lease_live"]

    await until(lapsed, "the lease to lapse")


def post(c: httpx.AsyncClient, idem_key: str = "k1", body: Any = None) -> Awaitable[httpx.Response]:
    return c.post(
        PAYOUTS, json=BODY if body is None else body, headers={"idempotency-key": idem_key}
    )


async def finish(task: asyncio.Task[httpx.Response]) -> httpx.Response:
    return await asyncio.wait_for(task, BOUND)


def lease_app(store: Any, pool: Any, **changes: Any) -> Any:
    return build_lease_app(store, pool, LEASE_POLICY.replace(**changes))


class PausedHeartbeatStore(PostgresStore):
    """The store of an executor that cannot renew its lease (a paused or partitioned process).

    Heartbeats run every lease/3 and keep a merely slow executor alive (see the test of a long
    handler), so a *stale* executor has to be one whose heartbeats never reach the database. The
    method reports success, as a paused process would not notice either: only the fence can stop
    it, which is what these tests show.
    """

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        return True


class WatchRecorder(PostgresStore):
    """Records how duplicates wait: whether LISTEN was up, and each wait's timeout."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.watches: list[Any] = []
        self.waits: list[float] = []
        #: Each wait's answer: True, woken by a notification; False, its time ran out.
        self.woken: list[bool] = []
        self.watching = 0

    @asynccontextmanager
    async def watch(self, key: RecordKey) -> AsyncIterator[Any]:
        async with super().watch(key) as inner:
            self.watches.append(inner)
            self.watching += 1
            try:
                yield _RecordedWatch(inner, self.waits, self.woken)
            finally:
                self.watching -= 1

    @property
    def listening(self) -> list[bool]:
        """Whether each watch can be woken by a notification now (LISTEN connects in the
        background: a first watch polls until it is up)."""
        return [watch.listening for watch in self.watches]


class _RecordedWatch:
    def __init__(self, inner: Any, waits: list[float], woken: list[bool]) -> None:
        self._inner = inner
        self._waits = waits
        self._woken = woken

    async def wait(self, seconds: float) -> bool:
        self._waits.append(seconds)
        woken: bool = await self._inner.wait(seconds)
        self._woken.append(woken)
        return woken


# == 1. The happy path ==========================================================================


@pytest.mark.parametrize("fence", [None, "before", "after"])
async def test_happy_path_claim_commits_first_then_outcome_and_fenced_writes_together(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], fence: str | None
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    gate = asyncio.Event()
    probe.steps = [Step(gate=gate, fence=fence)]
    async with client(app) as c:
        task = spawn(post(c))
        await asyncio.wait_for(probe.entered.wait(), BOUND)

        # While the handler runs, the claim is committed: another connection sees it pending,
        # under a live lease and the handler's generation, with no response.
        held = await row(bank)
        assert held is not None
        assert held["state"] == "pending"
        assert held["mode"] == "lease"
        assert held["lease_live"]
        assert held["response_status"] is None
        ctx = probe.contexts[0]
        assert held["generation"] == ctx.generation == ctx.fencing_token
        assert ctx.downstream_key == await dkey(bank)
        # The downstream effect is outside our transaction; a fenced write is not committed yet.
        assert await downstream_rows(bank) == 1
        assert await count(bank, "test_ledger") == 0

        gate.set()
        first = await finish(task)
        assert first.status_code == 201, first.text
        assert "idempotent-replayed" not in first.headers
        assert first.json() == {
            "dkey": await dkey(bank),
            "amount": 100,
            "generation": ctx.generation,
            "call": 1,
        }
        done = await row(bank)
        assert done is not None
        assert done["state"] == "succeeded"
        assert done["lease_expires_at"] is None
        assert done["response_status"] == 201
        assert done["response_body"] == first.content
        assert await count(bank, "test_ledger") == (0 if fence is None else 1)

        replay = await post(c)
        assert_replay_of(replay, first)
    assert probe.calls == 1
    assert await downstream_rows(bank) == 1
    assert await count(bank, "test_ledger") == (0 if fence is None else 1)


# == 3. A stale executor arriving late ==========================================================


@pytest.mark.parametrize("expiry", [LeaseExpiry.TAKEOVER, LeaseExpiry.UNKNOWN])
async def test_a_duplicate_waits_no_longer_than_its_bound_on_an_executor_writing_past_its_lease(
    pool: asyncpg.Pool[Any], pg_store: PostgresStore, bank: asyncpg.Pool[Any], expiry: LeaseExpiry
) -> None:
    """The executor holds its fenced transaction (the record's row lock) past its lease. A
    duplicate finds the lease lapsed, and taking the claim over (or marking it unknown) needs
    that lock: it waits at most `wait_seconds`, then answers 409, and changes nothing."""
    policy = LEASE_POLICY.replace(lease_seconds=0.6, wait_seconds=0.3, on_lease_expiry=expiry)
    async with PausedHeartbeatStore(pool=pool, listen=False) as paused:
        app_a = build_lease_app(paused, bank, policy)
        app_b = build_lease_app(pg_store, bank, policy)
        probe_a, probe_b = probe_of(app_a), probe_of(app_b)
        gate = asyncio.Event()
        probe_a.steps = [Step(gate=gate, fence="before")]
        async with client(app_a) as ca, client(app_b) as cb:
            task_a = spawn(post(ca))
            await asyncio.wait_for(probe_a.entered.wait(), BOUND)
            await lease_lapsed(bank)
            try:
                dup = await asyncio.wait_for(post(cb), BOUND)
            finally:
                gate.set()
            a = await finish(task_a)
        assert_problem(dup, 409, "request-in-flight")
        assert probe_b.calls == 0
        # Nothing was taken over: the executor's generation still held the record, and its
        # settlement (with its fenced write) committed.
        assert a.status_code == 201, a.text
        done = await row(bank)
        assert done is not None
        assert done["state"] == "succeeded"
        assert await count(bank, "test_ledger") == 1


async def test_a_stale_generation_the_handler_lets_escape_is_a_409_not_a_500(
    pool: asyncpg.Pool[Any], pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """A late executor whose handler does not catch the StaleGeneration of its fenced write gets
    the same answer as one that does: 409 request-in-flight (retry for the outcome), and the
    newer owner's record stands."""
    policy = LEASE_POLICY.replace(lease_seconds=0.6, on_lease_expiry=LeaseExpiry.TAKEOVER)
    async with PausedHeartbeatStore(pool=pool, listen=False) as paused:
        app_a = build_lease_app(paused, bank, policy)
        app_b = build_lease_app(pg_store, bank, policy)
        probe_a = probe_of(app_a)
        gate = asyncio.Event()
        probe_a.steps = [Step(gate=gate, fence="after, uncaught")]
        async with client(app_a) as ca, client(app_b) as cb:
            task_a = spawn(post(ca))
            await asyncio.wait_for(probe_a.entered.wait(), BOUND)
            await lease_lapsed(bank)
            b = await asyncio.wait_for(post(cb), BOUND)
            assert b.status_code == 201, b.text
            gate.set()
            a = await finish(task_a)
            assert_problem(a, 409, "request-in-flight")
            assert a.headers["retry-after"] == "1"
            after = await row(bank)
            assert after is not None
            assert after["state"] == "succeeded"
            assert after["response_body"] == b.content
            assert await count(bank, "test_ledger") == 0  # neither wrote on a fence (B: default)
            retry = await post(ca)
            assert_replay_of(retry, b)


async def test_seed_late_stale_executor_is_fenced_out_after_a_takeover(
    pool: asyncpg.Pool[Any], pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """A is paused past its lease; B takes over and completes; A's late writes are refused."""
    policy = LEASE_POLICY.replace(lease_seconds=0.6, on_lease_expiry=LeaseExpiry.TAKEOVER)
    async with PausedHeartbeatStore(pool=pool, listen=False) as paused:
        app_a = build_lease_app(paused, bank, policy)
        app_b = build_lease_app(pg_store, bank, policy)
        probe_a, probe_b = probe_of(app_a), probe_of(app_b)
        gate = asyncio.Event()
        probe_a.steps = [Step(gate=gate, fence="after")]
        probe_b.steps = [Step(fence="after")]
        async with client(app_a) as ca, client(app_b) as cb:
            task_a = spawn(post(ca))
            await asyncio.wait_for(probe_a.entered.wait(), BOUND)
            gen_a = probe_a.contexts[0].generation
            await lease_lapsed(bank)

            b = await asyncio.wait_for(post(cb), BOUND)
            assert b.status_code == 201, b.text
            assert "idempotent-replayed" not in b.headers
            gen_b = b.json()["generation"]
            assert gen_b > gen_a
            assert b.json()["dkey"] == await dkey(bank), "a takeover reuses the downstream key"
            assert await count(bank, "test_ledger") == 1  # B's fenced write

            gate.set()  # A wakes up, late
            a = await finish(task_a)
            assert_problem(a, 409, "request-in-flight")
            assert a.headers["retry-after"] == "1"
            assert probe_a.stale == [gen_a], "A's fenced_connection() must raise StaleGeneration"

            after = await row(bank)
            assert after is not None
            assert after["state"] == "succeeded"
            assert after["generation"] == gen_b
            assert after["response_body"] == b.content
            assert await count(bank, "test_ledger") == 1, "A's fenced write committed"
            assert await downstream_rows(bank) == 1

            retry = await post(cb)
            assert_replay_of(retry, b)
    assert probe_a.calls == 1
    assert probe_b.calls == 1


class EventLog:
    """An observer that keeps each decision's event and generation."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def event(self, event: Any, attributes: Any) -> None:
        self.events.append((str(event), attributes.get("generation")))

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Any) -> Iterator[None]:
        yield


@pytest.mark.parametrize("declare", [None, Outcome.RELEASE])
async def test_a_stale_executor_whose_handler_raises_is_told_another_execution_owns_the_key(
    pool: asyncpg.Pool[Any], pg_store: PostgresStore, bank: asyncpg.Pool[Any], declare: Any
) -> None:
    """A is paused past its lease; B takes over and completes; A's fenced write is refused and
    its handler then raises (its own error, as a handler that gives up does). A's client got a
    plain 500 and an `unresolved` event was counted for a record nobody marked unknown (B's
    outcome stood); a stale executor that returned got 409 request-in-flight. Both now get the
    409 (retry for the outcome), and the fenced write's refusal sets `lease_lost`, which only a
    heartbeat did (and a paused process's heartbeat never notices)."""
    policy = LEASE_POLICY.replace(lease_seconds=0.6, on_lease_expiry=LeaseExpiry.TAKEOVER)
    events = EventLog()
    async with PausedHeartbeatStore(pool=pool, listen=False) as paused:
        app_a = build_lease_app(paused, bank, policy, observers=[events])
        app_b = build_lease_app(pg_store, bank, policy)
        probe_a = probe_of(app_a)
        gate = asyncio.Event()
        probe_a.steps = [Step(gate=gate, fence="after", fail="late", declare=declare)]
        async with client(app_a) as ca, client(app_b) as cb:
            task_a = spawn(post(ca))
            await asyncio.wait_for(probe_a.entered.wait(), BOUND)
            gen_a = probe_a.contexts[0].generation
            await lease_lapsed(bank)
            b = await asyncio.wait_for(post(cb), BOUND)
            assert b.status_code == 201, b.text
            gate.set()
            a = await finish(task_a)
            assert_problem(a, 409, "request-in-flight")
            assert a.headers["retry-after"] == "1"
            assert probe_a.stale == [gen_a]
            assert probe_a.contexts[0].lease_lost.is_set()
            after = await row(bank)
            assert after is not None
            assert after["state"] == "succeeded"
            assert after["response_body"] == b.content
            retry = await post(ca)
            assert_replay_of(retry, b)
    assert ("claimed", gen_a) in events.events
    # A's end counted once, as its own claim's (`stale`): not `unresolved` (nobody marked the
    # record unknown), nor a duplicate's `in_flight`.
    assert [e for e in events.events if e[1] == gen_a and e[0] != "claimed"] == [("stale", gen_a)]
    assert not any(e[0] == "in_flight" for e in events.events)


async def test_stale_executor_holding_its_fence_blocks_the_takeover_and_wins(
    pool: asyncpg.Pool[Any], pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """A opened its fenced transaction before its lease lapsed: B's takeover finds the row lock
    held and waits until A commits (in the process, without a connection: it waited inside
    PostgreSQL, holding one, until probing found a storm of such waits took a small pool),
    then finds A's outcome and replays it (one execution)."""
    policy = LEASE_POLICY.replace(lease_seconds=0.6, on_lease_expiry=LeaseExpiry.TAKEOVER)
    async with PausedHeartbeatStore(pool=pool, listen=False) as paused:
        app_a = build_lease_app(paused, bank, policy)
        app_b = build_lease_app(pg_store, bank, policy)
        probe_a, probe_b = probe_of(app_a), probe_of(app_b)
        gate = asyncio.Event()
        probe_a.steps = [Step(fence="before", gate=gate)]
        async with client(app_a) as ca, client(app_b) as cb:
            task_a = spawn(post(ca))
            await asyncio.wait_for(probe_a.entered.wait(), BOUND)
            await lease_lapsed(bank)

            task_b = spawn(post(cb))
            await wait_for_waiters(app_b)  # B's takeover found A's row lock held
            assert await lock_waiters(bank) == 0
            assert not task_b.done()
            assert await state_of(bank) == "pending"

            gate.set()
            a = await finish(task_a)
            b = await finish(task_b)
    assert a.status_code == 201, a.text
    assert_replay_of(b, a)
    assert probe_b.calls == 0
    assert probe_a.stale == []
    assert await count(bank, "test_ledger") == 1
    assert await downstream_rows(bank) == 1
    done = await row(bank)
    assert done is not None
    assert done["generation"] == a.json()["generation"]


async def test_heartbeat_notices_a_takeover_and_the_late_completion_is_refused(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    app = lease_app(pg_store, bank, lease_seconds=0.6)
    probe = probe_of(app)
    gate = asyncio.Event()
    probe.steps = [Step(gate=gate, fence="after")]
    async with client(app) as c:
        task = spawn(post(c))
        await asyncio.wait_for(probe.entered.wait(), BOUND)
        ctx = probe.contexts[0]
        # Another process takes the record over (one statement: a new generation).
        new = await bank.fetchval(
            "UPDATE idem_requests SET generation = nextval('idem_generation_seq')"
            " WHERE idem_key = 'k1' RETURNING generation"
        )
        await asyncio.wait_for(ctx.lease_lost.wait(), BOUND)
        gate.set()
        late = await finish(task)
    assert_problem(late, 409, "request-in-flight")
    assert probe.stale == [ctx.generation]
    assert await count(bank, "test_ledger") == 0
    after = await row(bank)
    assert after is not None
    assert after["state"] == "pending"
    assert after["generation"] == new


# == 4. Heartbeats keep a long handler's claim ==================================================


async def test_long_handler_kept_alive_by_heartbeats_is_not_taken_over(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    app = lease_app(
        pg_store,
        bank,
        lease_seconds=0.6,
        on_lease_expiry=LeaseExpiry.TAKEOVER,
        wait_seconds=0.3,
    )
    probe = probe_of(app)
    probe.steps = [Step(delay=2.0)]
    async with client(app) as c:
        task = spawn(post(c))
        await asyncio.wait_for(probe.entered.wait(), BOUND)
        await asyncio.sleep(1.0)  # well past one lease
        alive = await row(bank)
        assert alive is not None
        assert alive["state"] == "pending"
        assert alive["lease_live"]
        assert alive["renewed"], "no heartbeat renewed the lease"

        started = time.monotonic()
        duplicate = await asyncio.wait_for(post(c), BOUND)
        assert_problem(duplicate, 409, "request-in-flight")
        assert duplicate.headers["retry-after"] == "1"
        assert time.monotonic() - started < 1.0
        assert not task.done()

        first = await finish(task)
    assert first.status_code == 201, first.text
    assert first.json()["generation"] == alive["generation"]
    assert probe.calls == 1
    assert await downstream_rows(bank) == 1
    assert await state_of(bank) == "succeeded"


# == 5. Outcomes, unknown results and reconciliation ===========================================


async def test_seed_unknown_downstream_result_is_reconciled_as_happened(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    app = lease_app(pg_store, bank, reconciler=downstream_reconciler(bank))
    probe = probe_of(app)
    probe.steps = [Step(fail="after")]  # the bank took the money, its answer was lost
    async with client(app) as c:
        first = await post(c)
        assert first.status_code == 500
        unknown = await row(bank)
        assert unknown is not None
        assert unknown["state"] == "unknown"
        assert unknown["response_status"] is None
        assert await downstream_rows(bank) == 1

        retry = await post(c)
        assert retry.status_code == 201, retry.text
        assert retry.headers.get("idempotent-replayed") == "true"
        assert retry.json() == {"dkey": await dkey(bank), "amount": 100, "reconciled": True}
        done = await row(bank)
        assert done is not None
        assert done["state"] == "succeeded"
        assert trail(done["note"])[-1] == "reconciled unknown -> succeeded 201"
        assert done["generation"] == unknown["generation"]

        again = await post(c)
        assert again.content == retry.content
        assert again.headers.get("idempotent-replayed") == "true"
    assert probe.calls == 1
    assert await downstream_rows(bank) == 1


async def test_unknown_reconciled_as_not_happened_runs_again_once(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    app = lease_app(pg_store, bank, reconciler=downstream_reconciler(bank))
    probe = probe_of(app)
    probe.steps = [Step(fail="before")]  # failed before anything reached the bank
    async with client(app) as c:
        first = await post(c)
        assert first.status_code == 500
        unknown = await row(bank)
        assert unknown is not None
        assert unknown["state"] == "unknown"
        assert await downstream_rows(bank) == 0

        retry = await post(c)
        assert retry.status_code == 201, retry.text
        assert "idempotent-replayed" not in retry.headers
        assert retry.json()["generation"] > unknown["generation"]
        assert retry.json()["dkey"] == await dkey(bank)
        again = await post(c)
        assert_replay_of(again, retry)
    assert probe.calls == 2
    assert await downstream_rows(bank) == 1
    assert await state_of(bank) == "succeeded"


async def _still_unknown(rc: ReconcileContext) -> Reconciliation:
    return StillUnknown("the bank has not settled it yet")


async def _failing(rc: ReconcileContext) -> Reconciliation:
    raise ConnectionError("the bank is unreachable")


async def _too_slow(rc: ReconcileContext) -> Reconciliation:
    await asyncio.sleep(BOUND)
    return NotHappened()


async def _writes_then_fails(rc: ReconcileContext) -> Reconciliation:
    conn = await rc.fenced_connection()
    await conn.execute(LEDGER_INSERT, rc.tenant, "acc-1", 100)
    raise ConnectionError("the bank is unreachable")


@pytest.mark.parametrize(
    "reconciler", [None, _still_unknown, _failing, _too_slow, _writes_then_fails]
)
async def test_unresolved_reconciliation_answers_outcome_unknown_and_never_reruns(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], reconciler: Any
) -> None:
    app = lease_app(pg_store, bank, reconciler=reconciler, reconcile_timeout_seconds=0.3)
    probe = probe_of(app)
    probe.steps = [Step(fail="after")]
    async with client(app) as c:
        assert (await post(c)).status_code == 500
        generation = (await row(bank))["generation"]  # type: ignore[index]
        for _ in range(2):
            started = time.monotonic()
            retry = await asyncio.wait_for(post(c), BOUND)
            assert time.monotonic() - started < 2.0
            problem = assert_problem(retry, 409, "outcome-unknown")
            # Only a reconciler or an operator settles it: waiting a second changes nothing.
            assert "retry-after" not in retry.headers
            if reconciler is _still_unknown:
                assert "the bank has not settled it yet" in problem["detail"]
            after = await row(bank)
            assert after is not None
            assert after["state"] == "unknown"
            assert after["generation"] == generation
    assert probe.calls == 1
    assert await downstream_rows(bank) == 1
    assert await count(bank, "test_ledger") == 0


async def test_reconciler_fenced_writes_commit_with_happened(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    async def debit_and_confirm(rc: ReconcileContext) -> Reconciliation:
        conn = await rc.fenced_connection()
        await conn.execute(LEDGER_INSERT, rc.tenant, "acc-1", 100)
        # Not committed yet: the write and the outcome commit together.
        assert await count(bank, "test_ledger") == 0
        return Happened.json(201, {"reconciled": rc.downstream_key})

    app = lease_app(pg_store, bank, reconciler=debit_and_confirm)
    probe_of(app).steps = [Step(fail="after")]
    async with client(app) as c:
        assert (await post(c)).status_code == 500
        retry = await post(c)
    assert retry.status_code == 201, retry.text
    assert retry.headers.get("idempotent-replayed") == "true"
    assert retry.json() == {"reconciled": await dkey(bank)}
    assert await count(bank, "test_ledger") == 1
    assert await state_of(bank) == "succeeded"


async def test_5xx_response_in_lease_mode_is_unknown_and_its_fenced_writes_roll_back(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    probe.steps = [Step(status=503, fence="after")]
    async with client(app) as c:
        first = await post(c)
        assert first.status_code == 503  # the handler's own response reaches the client
        assert await state_of(bank) == "unknown"
        assert await count(bank, "test_ledger") == 0
        retry = await post(c)
        assert_problem(retry, 409, "outcome-unknown")
    assert probe.calls == 1


async def test_a_failed_settlement_in_the_fenced_transaction_releases_it(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    """The handler swallowed an error on its fenced connection and answered 201: recording the
    outcome in that aborted transaction fails. The transaction must end (no row lock left, no
    connection kept) so that a retry is answered, not blocked forever."""
    app = lease_app(pg_store, bank, lease_seconds=0.6)
    probe = probe_of(app)
    probe.steps = [Step(fence="after", poison=True)]
    async with client(app) as c:
        first = await asyncio.wait_for(post(c), BOUND)
        assert first.status_code == 500
        assert await idle_in_transaction(bank) == 0, "the fenced transaction was left open"
        assert await count(bank, "test_ledger") == 0
        await lease_lapsed(bank)
        retry = await asyncio.wait_for(post(c), BOUND)
    assert_problem(retry, 409, "outcome-unknown")
    assert probe.calls == 1
    assert await state_of(bank) == "unknown"


@pytest.mark.parametrize("how", ["201", "raise"])
async def test_declared_release_deletes_the_record_and_a_retry_runs_again(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], how: str
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    if how == "raise":
        probe.steps = [Step(declare=Outcome.RELEASE, fail="before")]
    else:
        probe.steps = [Step(declare=Outcome.RELEASE, fence="after")]
    async with client(app) as c:
        first = await post(c)
        assert first.status_code == (500 if how == "raise" else 201)
        assert await row(bank) is None
        assert await count(bank, "test_ledger") == 0  # released: the fenced write rolled back
        retry = await post(c)
        assert retry.status_code == 201
        assert "idempotent-replayed" not in retry.headers
    assert probe.calls == 2
    assert await state_of(bank) == "succeeded"


async def test_402_is_failed_final_and_replayed(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    probe.steps = [Step(status=402, fence="after")]
    async with client(app) as c:
        first = await post(c)
        assert first.status_code == 402
        assert await state_of(bank) == "failed_final"
        assert await count(bank, "test_ledger") == 1  # stored outcomes commit fenced writes
        replay = await post(c)
        assert_replay_of(replay, first)
    assert probe.calls == 1


@pytest.mark.parametrize("status", [400, 409, 422, 429])
async def test_release_status_deletes_the_record_and_a_retry_runs_again(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], status: int
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    probe.steps = [Step(status=status, fence="after", downstream=False)]
    async with client(app) as c:
        first = await post(c)
        assert first.status_code == status
        assert "idempotent-replayed" not in first.headers
        assert await row(bank) is None
        assert await count(bank, "test_ledger") == 0
        retry = await post(c)
        assert retry.status_code == 201
        assert retry.json()["generation"] > first.json()["generation"]
    assert probe.calls == 2
    assert await count(bank, "test_ledger") == 0
    assert await state_of(bank) == "succeeded"


async def test_operator_allow_retry_lets_the_next_retry_run_with_the_same_downstream_key(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    probe.steps = [Step(fail="before")]
    async with client(app) as c:
        assert (await post(c)).status_code == 500
        assert_problem(await post(c), 409, "outcome-unknown")
        generation = (await row(bank))["generation"]  # type: ignore[index]
        assert await pg_store.allow_retry(rkey(), generation, "operator: the bank has nothing")
        retry = await post(c)
    assert retry.status_code == 201, retry.text
    assert retry.json()["generation"] > generation
    assert retry.json()["dkey"] == await dkey(bank)
    assert probe.calls == 2
    assert await downstream_rows(bank) == 1


# == 6. Waiting for the original: NOTIFY, polling, 202 ========================================


@pytest.mark.parametrize("listen", [True, False])
@pytest.mark.needs_listen
async def test_waiter_is_woken_by_notify_well_before_its_poll(
    pool: asyncpg.Pool[Any], bank: asyncpg.Pool[Any], listen: bool
) -> None:
    store = WatchRecorder(pool=pool, listen=listen)
    async with store:
        app = lease_app(store, bank, wait_seconds=10.0)
        # The waiter's: another process's middleware on the same database (a duplicate of a
        # request of its own process is woken in-process: test_lease_held_wake.py).
        other = lease_app(store, bank, wait_seconds=10.0)
        probe = probe_of(app)
        gate = asyncio.Event()
        probe.steps = [Step(gate=gate)]
        async with client(app) as c, client(other) as elsewhere:
            original = spawn(post(c))
            await asyncio.wait_for(probe.entered.wait(), BOUND)
            waiter = spawn(post(elsewhere))

            # Hold the original until the waiter's poll backoff has grown to its 1 s cap.
            async def capped() -> bool:
                return bool(store.waits) and store.waits[-1] >= 0.99

            await until(capped, "the waiter's poll interval to reach 1 s")
            await asyncio.sleep(0.1)
            assert store.listening == [listen]
            assert not waiter.done()

            before = len(store.woken)
            gate.set()
            first = await finish(original)
            replay = await finish(waiter)
    assert first.status_code == 201
    assert_replay_of(replay, first)
    assert probe.calls == 1
    # Told by the waits' own answers, not by the clock (a loaded machine's wall clock says
    # little): with LISTEN, the wait that ended was woken by the outcome's notification (its
    # poll was about a second away); without, only the poll found it.
    ended = store.woken[before:]
    if listen:
        assert ended == [True], f"the waiter was not woken by NOTIFY: {ended}"
    else:
        assert ended, "the waiter did not wait"
        assert not any(ended), ended


async def test_accept_while_in_flight_answers_202_with_location(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    app = lease_app(pg_store, bank, wait_seconds=0.2, accept_while_in_flight=True)
    probe = probe_of(app)
    gate = asyncio.Event()
    probe.steps = [Step(gate=gate)]
    async with client(app) as c:
        original = spawn(post(c))
        await asyncio.wait_for(probe.entered.wait(), BOUND)
        accepted = await asyncio.wait_for(post(c), BOUND)
        assert accepted.status_code == 202, accepted.text
        location = accepted.headers["location"]
        # (`request`: a digest of this request, so the status resource never reads another's.)
        assert re.fullmatch(
            r"/idempotency/status\?operation=POST\+%2Fpayouts&key=k1&request=[0-9a-f]{24}", location
        )
        assert accepted.headers["retry-after"] == "1"
        assert accepted.json() == {"status": "processing", "location": location}
        assert "idempotent-replayed" not in accepted.headers
        gate.set()
        first = await finish(original)
        replay = await post(c)
    assert_replay_of(replay, first)
    assert probe.calls == 1


# == 7. Retention and purge =====================================================================


async def test_seed_retention_boundary_purge_never_touches_pending_or_unknown(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    store = pg_store
    response = StoredResponse(201, [], b"{}")
    generations: dict[str, int] = {}
    for name in ("pending", "unknown", "old-pending", "old-unknown", "old-ok", "old-402", "ok"):
        claim = await store.claim_lease(
            rkey(name), b"fp", retention_seconds=60.0, lease_seconds=30.0
        )
        generations[name] = claim.generation
    for name in ("unknown", "old-unknown"):
        assert await store.settle(
            rkey(name), generations[name], State.PENDING, Settlement(State.UNKNOWN)
        )
    for name, state in (
        ("old-ok", State.SUCCEEDED),
        ("old-402", State.FAILED_FINAL),
        ("ok", State.SUCCEEDED),
    ):
        settlement = Settlement(
            state, replace(response, status=201 if state is State.SUCCEEDED else 402)
        )
        assert await store.settle(rkey(name), generations[name], State.PENDING, settlement)
    # Ancient unresolved records (their lease too), and finished ones past their retention.
    await pool.execute(
        "UPDATE idem_requests SET created_at = now() - interval '10 years',"
        " updated_at = now() - interval '10 years',"
        " lease_expires_at = CASE WHEN state = 'pending' THEN now() - interval '10 years' END"
        " WHERE idem_key IN ('old-pending', 'old-unknown')"
    )
    await pool.execute(
        "UPDATE idem_requests SET expires_at = now() - interval '1 second'"
        " WHERE idem_key IN ('old-ok', 'old-402')"
    )
    assert await store.purge(batch_size=1) == 2
    assert await store.purge() == 0
    left = {
        r["idem_key"]: r["state"]
        for r in await pool.fetch("SELECT idem_key, state FROM idem_requests")
    }
    assert left == {
        "pending": "pending",
        "unknown": "unknown",
        "old-pending": "pending",
        "old-unknown": "unknown",
        "ok": "succeeded",
    }


@pytest.mark.parametrize("purged", [False, True])
async def test_expired_succeeded_key_is_claimable_again_in_lease_mode(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], purged: bool
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    async with client(app) as c:
        first = await post(c)
        assert first.status_code == 201
        await bank.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        if purged:
            assert await pg_store.purge() == 1
            assert await row(bank) is None
        again = await post(c)
        replay = await post(c)
    # The record forgot the first request: this is a new execution (the seed's "after
    # retention: claimed"), a new life of the record, so the bank is sent a new downstream key
    # and makes a new transfer (the same key would have been deduplicated into the old one).
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert again.json()["generation"] > first.json()["generation"]
    assert again.json()["call"] == 2
    assert again.json()["dkey"] != first.json()["dkey"]
    assert_replay_of(replay, again)
    assert probe.calls == 2
    assert await downstream_rows(bank) == 2


@pytest.mark.parametrize("state", ["pending", "unknown"])
async def test_ancient_unresolved_record_is_never_rerun(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], state: str
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    probe.steps = [Step(fail="after")]
    async with client(app) as c:
        assert (await post(c)).status_code == 500  # unknown, under this request's fingerprint
        # Made ancient; a pending one as if its executor crashed ten years ago.
        await bank.execute(
            "UPDATE idem_requests SET state = $1, created_at = now() - interval '10 years',"
            " updated_at = now() - interval '10 years',"
            " lease_expires_at = CASE WHEN $1 = 'pending' THEN now() - interval '10 years' END",
            state,
        )
        assert await pg_store.purge() == 0
        retry = await post(c)
    assert_problem(retry, 409, "outcome-unknown")
    assert probe.calls == 1
    assert await state_of(bank) == "unknown"


# == 8. The seed's other failure windows =======================================================


async def test_seed_same_key_concurrency_one_execution(
    pool: asyncpg.Pool[Any], bank: asyncpg.Pool[Any], db_route: str
) -> None:
    store = WatchRecorder(pool=pool, listen=db_route != "pgbouncer")
    async with store:
        app = lease_app(store, bank, wait_seconds=BOUND)
        probe = probe_of(app)
        gate = asyncio.Event()
        probe.steps = [Step(gate=gate, fence="after")]
        async with client(app) as c:
            tasks = [spawn(post(c)) for _ in range(20)]
            await asyncio.wait_for(probe.entered.wait(), BOUND)

            async def all_waiting() -> bool:
                return bool(store.watching == 19)

            await until(all_waiting, "19 duplicates waiting")
            gate.set()
            responses = await asyncio.wait_for(asyncio.gather(*tasks), BOUND)
    assert [r.status_code for r in responses] == [201] * 20
    originals = [r for r in responses if "idempotent-replayed" not in r.headers]
    assert len(originals) == 1
    assert {r.content for r in responses} == {originals[0].content}
    assert probe.calls == 1
    assert await downstream_rows(bank) == 1
    assert await count(bank, "test_ledger") == 1


async def test_seed_same_key_other_payload_is_422_in_every_state(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any]
) -> None:
    other = {"account": "acc-1", "amount": 999}
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    gate = asyncio.Event()
    probe.steps = [Step(gate=gate), Step(fail="after")]
    async with client(app) as c:
        task = spawn(post(c, "k1"))
        await asyncio.wait_for(probe.entered.wait(), BOUND)
        assert_problem(await post(c, "k1", other), 422, "key-reused")  # pending
        gate.set()
        assert (await finish(task)).status_code == 201
        assert_problem(await post(c, "k1", other), 422, "key-reused")  # succeeded
        assert (await post(c, "k2")).status_code == 500
        assert await state_of(bank, "k2") == "unknown"
        assert_problem(await post(c, "k2", other), 422, "key-reused")  # unknown
    assert probe.calls == 2
    assert await downstream_rows(bank) == 2
    amounts = {r["amount"] for r in await bank.fetch("SELECT amount FROM test_downstream")}
    assert amounts == {100}


def _scope(body: bytes, idem_key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PAYOUTS,
        "raw_path": PAYOUTS.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"test"),
            (b"authorization", b"Bearer demo-a"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"idempotency-key", idem_key.encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }


@pytest.mark.parametrize("how", ["send-fails", "nobody-reads"])
async def test_seed_committed_but_response_lost_retry_gets_the_replay(
    pg_store: PostgresStore, bank: asyncpg.Pool[Any], how: str
) -> None:
    app = lease_app(pg_store, bank)
    probe = probe_of(app)
    probe.steps = [Step(fence="after")]
    body = orjson.dumps(BODY)
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if how == "send-fails":
            raise OSError("connection reset by peer")
        sent.append(message)  # written into a socket nobody reads any more

    if how == "send-fails":
        with pytest.raises(OSError, match="connection reset"):
            await asyncio.wait_for(app(_scope(body, "k1"), receive, send), BOUND)
    else:
        await asyncio.wait_for(app(_scope(body, "k1"), receive, send), BOUND)
        assert sent[0]["status"] == 201
    # The outcome was committed before the response was sent.
    committed = await row(bank)
    assert committed is not None
    assert committed["state"] == "succeeded"
    assert await count(bank, "test_ledger") == 1
    async with client(app) as c:
        retry = await post(c)
    assert retry.status_code == 201
    assert retry.headers.get("idempotent-replayed") == "true"
    assert retry.content == committed["response_body"]
    assert retry.json()["call"] == 1
    assert probe.calls == 1
    assert await downstream_rows(bank) == 1
    assert await count(bank, "test_ledger") == 1
