"""A lease-mode execution between its handler's answer and its recorded outcome: the renewals
around the settlement, a record a duplicate marked `unknown` meanwhile, a release sent again
after a blip, and a streamed response's renewals once it settled before its first byte
(docs/lease-mode.md). Every wait ends on a condition, in bounded loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from idem_middleware import (
    IdempotencyContext,
    LeaseExpiry,
    Mode,
    Outcome,
    Policy,
    PostgresStore,
    get_context,
)
from idem_middleware.errors import StaleGeneration, StoreError
from idem_middleware.jobs import idempotent_job
from idem_middleware.ops import reopen
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from idem_middleware.store.base import RecordKey, Settlement, State, Store
from tests.apps import BOUND, assert_problem, assert_replay_of, client, one_route_app
from tests.integration.test_lease_fence_windows import until

KEY = RecordKey("tenant-a", "POST /charges", "k1")
HEADERS = {"Idempotency-Key": "k1"}
BLIP = StoreError("ConnectionDoesNotExistError: connection was closed in the middle of operation")


def lease_lost_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("lease lost")]


class Settling(PostgresStore):
    """Notes its renewals' answers, and when a settlement is first asked of it."""

    renewals: list[bool]
    settling: asyncio.Event

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        alive = await super().heartbeat(key, generation, lease_seconds)
        self.renewals.append(alive)
        return alive

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        self.settling.set()
        return await super().settle(key, generation, expected, s)


@pytest.fixture
async def small(
    pool: asyncpg.Pool[Any], db_target: tuple[str, dict[str, Any]]
) -> AsyncIterator[Settling]:
    """A store whose pool has one connection (its renewals have one of their own)."""
    dsn, _ = db_target
    store = Settling(dsn=dsn, min_size=1, max_size=1, listen=False)
    store.renewals, store.settling = [], asyncio.Event()
    async with store:
        yield store


async def lease_until(pool: asyncpg.Pool[Any], key: str) -> Any:
    return await pool.fetchval(
        "SELECT lease_expires_at FROM idem_requests WHERE idem_key = $1", key
    )


async def renewed_past(pool: asyncpg.Pool[Any], key: str, granted: Any) -> None:
    """Until a renewal extends the lease granted before the settlement began (the settlement
    still waits for the pool's one connection)."""

    async def later() -> bool:
        until_now = await lease_until(pool, key)
        return until_now is not None and until_now > granted

    await until(later, "a renewal while the settlement waits for a pooled connection")


async def test_renewals_go_on_while_the_settlement_waits_for_a_pooled_connection(
    small: Settling,
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handler answers while other work holds the pool's one connection: its settlement
    waits for it (up to `acquire_timeout`). Renewals stopped before the settlement, so the lease
    lapsed while it waited: a duplicate in another process took the record over and ran the
    handler a second time (or marked it `unknown`), and the first client got 409. Now renewals
    go on until the settlement returns; the duplicate finds the request in flight."""
    policy = Policy(
        mode=Mode.LEASE, lease_seconds=1.2, wait_seconds=0.2, on_lease_expiry=LeaseExpiry.TAKEOVER
    )
    entered, release = asyncio.Event(), asyncio.Event()
    runs: list[IdempotencyContext] = []

    async def charge(request: Request) -> Response:
        runs.append(get_context(request))
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return JSONResponse({"charged": len(runs)}, status_code=201)

    policies = {"POST /charges": policy}
    app = one_route_app("/charges", charge, store=small, policies=policies)
    other = one_route_app("/charges", charge, store=pg_store, policies=policies)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(app) as c, client(other) as c2:
            first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await asyncio.wait_for(entered.wait(), BOUND)

            async def renewed() -> bool:
                return bool(small.renewals)

            await until(renewed, "the first renewal (it opens the renewals' connection)")
            async with small.pool.acquire():  # other work holds the pool's one connection
                release.set()
                await asyncio.wait_for(small.settling.wait(), BOUND)
                granted = await lease_until(pool, "k1")
                await renewed_past(pool, "k1", granted)
                duplicate = await asyncio.wait_for(
                    c2.post("/charges", json={}, headers=HEADERS), BOUND
                )
                assert_problem(duplicate, 409, "request-in-flight")
                assert not first.done()
            response = await asyncio.wait_for(first, BOUND)
            assert response.status_code == 201, response.text
            assert len(runs) == 1
            record = await pg_store.get(KEY)
            assert record is not None
            assert (record.state, record.generation) == (State.SUCCEEDED, runs[0].generation)
            assert_replay_of(await c2.post("/charges", json={}, headers=HEADERS), response)
    assert not runs[0].lease_lost.is_set()
    assert lease_lost_logged(caplog) == []


async def test_a_lease_jobs_renewals_go_on_while_its_settlement_waits_for_a_pooled_connection(
    small: Settling, pool: asyncpg.Pool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The same for a lease-mode job: its renewals stopped before its settlement, and the lease
    lapsed while the settlement waited for the pool."""
    entered, release = asyncio.Event(), asyncio.Event()
    seen: list[IdempotencyContext] = []

    @idempotent_job(small, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=1.2)
    async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
        seen.append(job)
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return {"paid": ref}

    async def renewed() -> bool:
        return bool(small.renewals)

    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        run = asyncio.ensure_future(payout(ref="p1"))
        await asyncio.wait_for(entered.wait(), BOUND)
        await until(renewed, "the first renewal (it opens the renewals' connection)")
        async with small.pool.acquire():
            release.set()
            await asyncio.wait_for(small.settling.wait(), BOUND)
            granted = await lease_until(pool, "p1")
            await renewed_past(pool, "p1", granted)
            assert not run.done()
        assert await asyncio.wait_for(run, BOUND) == {"paid": "p1"}
    record = await small.get(RecordKey("", "payout", "p1"))
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert not seen[0].lease_lost.is_set()
    assert lease_lost_logged(caplog) == []


def reconciled_to(happened: bool) -> Any:
    async def reconcile(rc: ReconcileContext) -> Reconciliation:
        return Happened.json(201, {"reconciled": True})

    return reconcile if happened else None


@pytest.mark.parametrize("reconciled", [False, True], ids=["marked-unknown", "reconciled"])
async def test_an_outcome_is_recorded_if_a_duplicate_only_marked_the_record_unknown(
    store: Store, monkeypatch: pytest.MonkeyPatch, reconciled: bool
) -> None:
    """The renewals cannot reach the store, the lease lapses, and a duplicate marks the record
    `unknown` under the same generation (nobody takes it over); then the handler answers 201.
    Its completion expected `pending` and was refused: the client was told to retry, and every
    retry got `409 outcome-unknown` for an outcome the handler had produced. Now it is recorded
    from `unknown` too. A reconciler that settled the record first keeps its outcome: the
    completion is then refused, and the client told to retry for it."""

    async def down(key: RecordKey, generation: int, lease_seconds: float) -> bool:
        raise StoreError("ConnectionRefusedError: the server is down")

    monkeypatch.setattr(store, "heartbeat", down)
    entered, release = asyncio.Event(), asyncio.Event()
    runs: list[IdempotencyContext] = []

    async def charge(request: Request) -> Response:
        runs.append(get_context(request))
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return JSONResponse({"charged": True}, status_code=201)

    policy = Policy(
        mode=Mode.LEASE, lease_seconds=0.3, wait_seconds=0.2, reconciler=reconciled_to(reconciled)
    )
    app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
    async with client(app) as c:
        first, duplicate = await duplicate_after_the_lapse(c, store, entered)
        record = await store.get(KEY)
        assert record is not None
        assert record.generation == runs[0].generation
        if reconciled:
            assert duplicate.status_code == 201, duplicate.text
            assert duplicate.json() == {"reconciled": True}
            assert record.state is State.SUCCEEDED
        else:
            assert_problem(duplicate, 409, "outcome-unknown")
            assert record.state is State.UNKNOWN
        release.set()
        response = await asyncio.wait_for(first, BOUND)
        retry = await c.post("/charges", json={}, headers=HEADERS)
    record = await store.get(KEY)
    assert record is not None
    assert (record.state, record.generation) == (State.SUCCEEDED, runs[0].generation)
    assert len(runs) == 1
    if reconciled:
        problem = assert_problem(response, 409, "request-in-flight")
        assert "lost its claim" in problem["detail"]
        assert "taken over or marked unknown" in problem["detail"]
        assert retry.json() == {"reconciled": True}
    else:
        assert response.status_code == 201, response.text
        assert response.json() == {"charged": True}
        assert_replay_of(retry, response)


async def test_a_late_outcome_is_refused_once_an_operator_reopened_the_record(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease lapses, a duplicate marks the record `unknown`, a reconciler settles it, an
    operator reopens it (they no longer trust that outcome): then the first execution, still
    running under the old generation, answers. Its outcome is not recorded over the reopen (a
    reopen takes a new generation, as every operator's move does), and what it wrote in its
    fenced transaction is refused with it."""

    async def down(key: RecordKey, generation: int, lease_seconds: float) -> bool:
        raise StoreError("ConnectionRefusedError: the server is down")

    monkeypatch.setattr(store, "heartbeat", down)
    entered, release = asyncio.Event(), asyncio.Event()
    runs: list[IdempotencyContext] = []

    async def charge(request: Request) -> Response:
        runs.append(get_context(request))
        if len(runs) == 1:
            entered.set()
            await asyncio.wait_for(release.wait(), BOUND)
        return JSONResponse({"charged": True}, status_code=201)

    policy = Policy(
        mode=Mode.LEASE, lease_seconds=0.3, wait_seconds=0.2, reconciler=reconciled_to(True)
    )
    app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
    async with client(app) as c:
        first, duplicate = await duplicate_after_the_lapse(c, store, entered)
        assert duplicate.json() == {"reconciled": True}
        await reopen(store, KEY, note="the bank disagrees")
        reopened = await store.get(KEY)
        assert reopened is not None
        assert reopened.state is State.UNKNOWN
        assert reopened.generation != runs[0].generation
        release.set()
        response = await asyncio.wait_for(first, BOUND)
    problem = assert_problem(response, 409, "request-in-flight")
    assert "lost its claim" in problem["detail"]
    record = await store.get(KEY)
    assert record is not None
    assert (record.state, record.generation) == (State.UNKNOWN, reopened.generation)
    assert len(runs) == 1


def blips_once(store: Store, monkeypatch: pytest.MonkeyPatch, outcome: str) -> list[str]:
    """The store's first release (or `unknown` mark) meets a blip, before it reaches the
    record; returns the log of the tries."""
    tries: list[str] = []
    if outcome == "release":
        real_release = store.release

        async def release(key: RecordKey, generation: int) -> bool:
            tries.append("release")
            if len(tries) == 1:
                raise BLIP
            return await real_release(key, generation)

        monkeypatch.setattr(store, "release", release)
        return tries
    real_settle = store.settle

    async def settle(key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if s.state is State.UNKNOWN:
            tries.append("unknown")
            if len(tries) == 1:
                raise BLIP
        return await real_settle(key, generation, expected, s)

    monkeypatch.setattr(store, "settle", settle)
    return tries


@pytest.mark.parametrize("how", ["held", "stream"])
@pytest.mark.parametrize("outcome", ["release", "unknown"])
async def test_a_release_or_unknown_after_a_fenced_transaction_is_sent_again_on_a_blip(
    store: Store, monkeypatch: pytest.MonkeyPatch, how: str, outcome: str
) -> None:
    """The handler opened its fenced connection and answered 422 ("fix and retry": the record is
    released) or 500 (`unknown`). Its fenced transaction rolls back first, and the release (or
    the mark) is a compare-and-set of its own; yet one blip on it was taken for a failed fenced
    COMMIT: not sent again, the client got 503 and the record stayed `unknown`, a request that
    did nothing waiting for an operator. Now it is sent again, as without a fenced
    transaction: the client gets the handler's answer."""
    tries = blips_once(store, monkeypatch, outcome)
    status = 422 if outcome == "release" else 500
    runs: list[int] = []

    async def charge(request: Request) -> Response:
        ctx = get_context(request)
        runs.append(ctx.generation)
        conn = await ctx.fenced_connection()
        if conn is not None:  # (the in-memory store's fence has no connection)
            await conn.execute("SELECT 1")
        if how == "held":
            return JSONResponse({"error": "insufficient input"}, status_code=status)

        async def body() -> AsyncIterator[bytes]:
            yield b'{"error": "insufficient input"}'

        return StreamingResponse(body(), status_code=status, media_type="application/json")

    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=0.2)
    app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
    async with client(app) as c:
        response = await asyncio.wait_for(c.post("/charges", json={}, headers=HEADERS), BOUND)
        assert response.status_code == status, response.text
        assert response.json() == {"error": "insufficient input"}
        assert tries == [outcome, outcome]
        record = await store.get(KEY)
        if outcome == "release":
            assert record is None  # free for the client's fixed retry
            retry = await c.post("/charges", json={}, headers=HEADERS)
            assert retry.status_code == 422
            assert len(runs) == 2
        else:
            assert record is not None
            assert record.state is State.UNKNOWN
            assert len(runs) == 1


async def test_a_lease_jobs_release_after_its_fenced_transaction_is_sent_again_on_a_blip(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a lease-mode job that opened its fenced connection and declared that it
    did nothing: its release met a blip, and the record was marked `unknown` (every redelivery
    then raised JobOutcomeUnknown). Now the release is sent again and the key is free."""
    tries = blips_once(store, monkeypatch, "release")
    runs: list[str] = []

    @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=30.0)
    async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
        runs.append(ref)
        await job.fenced_connection()
        job.declare(Outcome.RELEASE)
        return {"declined": ref}

    assert await asyncio.wait_for(payout(ref="p1"), BOUND) == {"declined": "p1"}
    assert tries == ["release", "release"]
    assert await store.get(RecordKey("", "payout", "p1")) is None
    assert await asyncio.wait_for(payout(ref="p1"), BOUND) == {"declined": "p1"}
    assert runs == ["p1", "p1"]


async def test_a_stream_settled_before_its_first_byte_renews_no_more(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A streamed response is settled before its first byte; its renewals went on while it
    streamed, the first one found the record settled, and the execution took that for a lost
    lease: `lease_lost` set for the rest of the stream, and a warning "lease lost", for an
    outcome that was recorded. Now the renewals stop once the early settlement is recorded."""
    lease = 0.3
    seen: list[IdempotencyContext] = []
    lost: list[bool] = []
    settled: list[bool] = []
    late: list[bool] = []  # the answers of renewals sent after the early settlement
    real_settle, real_heartbeat = store.settle, store.heartbeat

    async def settle(key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        done = await real_settle(key, generation, expected, s)
        settled.append(done)
        return done

    async def heartbeat(key: RecordKey, generation: int, lease_seconds: float) -> bool:
        after = bool(settled)
        alive = await real_heartbeat(key, generation, lease_seconds)
        if after:
            late.append(alive)
        return alive

    monkeypatch.setattr(store, "settle", settle)
    monkeypatch.setattr(store, "heartbeat", heartbeat)

    async def events(request: Request) -> Response:
        ctx = get_context(request)
        seen.append(ctx)

        async def body() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            # Long enough for several renewals to fall due (a third of the lease each).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ctx.lease_lost.wait(), lease * 2)
            lost.append(ctx.lease_lost.is_set())
            yield b"data: 2\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    policy = Policy(mode=Mode.LEASE, lease_seconds=lease, wait_seconds=0.2)
    app = one_route_app("/charges", events, store=store, policies={"POST /charges": policy})
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(app) as c:
            response = await asyncio.wait_for(c.post("/charges", json={}, headers=HEADERS), BOUND)
    assert response.status_code == 200
    assert response.text == "data: 1\n\ndata: 2\n\n"
    assert settled == [True]
    assert late == []
    assert lost == [False]
    assert not seen[0].lease_lost.is_set()
    assert lease_lost_logged(caplog) == []
    record = await store.get(KEY)
    assert record is not None
    assert record.state is State.SUCCEEDED


async def duplicate_after_the_lapse(
    c: Any, store: Store, entered: asyncio.Event
) -> tuple[asyncio.Task[Any], Any]:
    """POST /charges (held in its handler once `entered`), then, once its lease has lapsed, a
    duplicate: the first's task and the duplicate's response."""
    first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
    await asyncio.wait_for(entered.wait(), BOUND)

    async def lapsed() -> bool:
        record = await store.get(KEY)
        return record is not None and record.lease_expired

    await until(lapsed, "the lease to lapse")
    return first, await asyncio.wait_for(c.post("/charges", json={}, headers=HEADERS), BOUND)


def renewals_down(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every renewal fails: the lease lapses under a running handler."""

    async def down(key: RecordKey, generation: int, lease_seconds: float) -> bool:
        raise StoreError("ConnectionRefusedError: the server is down")

    monkeypatch.setattr(store, "heartbeat", down)


def success_blips_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[State]:
    """The store's first `succeeded` settlement meets a blip; returns the state each one
    expected, in order."""
    real_settle = store.settle
    finals: list[State] = []

    async def settle(key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if s.state is State.SUCCEEDED:
            finals.append(expected)
            if len(finals) == 1:
                raise BLIP
        return await real_settle(key, generation, expected, s)

    monkeypatch.setattr(store, "settle", settle)
    return finals


@pytest.mark.parametrize("blip", [False, True], ids=["settled-at-once", "sent-again"])
async def test_an_answer_after_a_refused_fenced_connection_is_not_recorded_over_unknown(
    store: Store, monkeypatch: pytest.MonkeyPatch, blip: bool
) -> None:
    """A duplicate marks the record `unknown` under the execution's own generation; the handler
    then asks for its fenced connection, is refused (`StaleGeneration`), catches it and answers
    201. Its fenced writes never happened, whatever it answered: the record stays `unknown`.
    It did when the settlement met a blip first and was sent again: the resend recorded the 201
    over `unknown`, as for a handler that never asked for a fenced connection."""

    renewals_down(store, monkeypatch)
    finals = success_blips_once(store, monkeypatch) if blip else []
    entered, release = asyncio.Event(), asyncio.Event()
    refused: list[str] = []

    async def charge(request: Request) -> Response:
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        try:
            await get_context(request).fenced_connection()
        except StaleGeneration as exc:
            refused.append(str(exc))
        return JSONResponse({"charged": True}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=0.3, wait_seconds=0.2)
    app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
    async with client(app) as c:
        first, duplicate = await duplicate_after_the_lapse(c, store, entered)
        assert_problem(duplicate, 409, "outcome-unknown")
        release.set()
        response = await asyncio.wait_for(first, BOUND)
    assert len(refused) == 1
    assert_problem(response, 409, "request-in-flight")
    record = await store.get(KEY)
    assert record is not None
    assert record.state is State.UNKNOWN
    if blip:
        assert finals[:2] == [State.PENDING, State.PENDING]  # (the blip, then sent again)


async def test_a_lease_jobs_result_after_a_refused_fenced_connection_is_not_recorded_over_unknown(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a lease-mode job: its record marked `unknown` under its generation, its
    fenced connection refused and caught, its settlement meeting a blip: the resend recorded
    its result over `unknown`. Now the run is told it lost its claim, and the record stays."""

    renewals_down(store, monkeypatch)
    finals = success_blips_once(store, monkeypatch)
    job_key = RecordKey("", "payout", "p1")
    marked = asyncio.Event()

    @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=0.3)
    async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
        await asyncio.wait_for(marked.wait(), BOUND)
        with contextlib.suppress(StaleGeneration):
            await job.fenced_connection()
        return {"paid": ref}

    run = asyncio.create_task(payout(ref="p1"))

    async def lapsed() -> bool:
        record = await store.get(job_key)
        return record is not None and record.lease_expired

    await until(lapsed, "the lease to lapse")
    record = await store.get(job_key)
    assert record is not None
    assert await store.expire_lease(job_key, record.generation)  # (as a duplicate does)
    marked.set()
    with pytest.raises(StaleGeneration):
        await asyncio.wait_for(run, BOUND)
    after = await store.get(job_key)
    assert after is not None
    assert (after.state, after.generation) == (State.UNKNOWN, record.generation)
    assert finals[:2] == [State.PENDING, State.PENDING]
