"""A reconciler's faults that are its own, not the store's: its fenced transaction cannot commit
(it went on after one of its statements failed, or broke a deferred constraint), or it raises a
CancelledError nobody asked of the run. Each is a failed reconciliation: the record stays
`unknown`, a batch goes on to the next record, and a client's retry is told `409
outcome-unknown`. A real cancellation of the run, and a store that fails, are still raised."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse

from idem_middleware import Mode, fence, idempotent
from idem_middleware.errors import FencedSettlementRefused, StoreError
from idem_middleware.fence import Verdict, run_reconciler
from idem_middleware.ops import ReconcileReport, reconcile_unknown
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, Store, StoredResponse
from tests.apps import LEDGER_INSERT, assert_problem, client, count, one_route_app
from tests.integration.test_cli import cli, insert

ROOT = Path(__file__).resolve().parents[2]
OPERATION = "POST /payouts"
FAILED = "Asking the downstream system failed; retry later."
HEADERS = {"idempotency-key": "k"}


async def _unknown(store: Store, *names: str) -> dict[str, int]:
    """Lease-mode `unknown` records, the first named the oldest: their generations."""
    generations = {}
    for name in names:
        key = RecordKey("t", OPERATION, name)
        claim = await store.claim_lease(key, b"f", retention_seconds=60, lease_seconds=30)
        assert isinstance(claim, Claimed)
        assert await store.settle(key, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
        generations[name] = claim.generation
        await asyncio.sleep(0.005)  # (updated_at orders them)
    return generations


async def _states(store: Store, *names: str) -> list[State]:
    found = [await store.get(RecordKey("t", OPERATION, name)) for name in names]
    return [record.state for record in found if record is not None]


async def _aborted(conn: Any) -> None:
    """A statement that fails, its error swallowed: the fenced transaction is aborted."""
    with contextlib.suppress(Exception):
        await conn.execute("SELECT 1/0")


async def _deferred_violation(conn: Any) -> None:
    """Writes that break a deferred constraint: nothing fails until COMMIT."""
    await conn.execute(
        "CREATE TEMP TABLE payout_once (k int UNIQUE DEFERRABLE INITIALLY DEFERRED) ON COMMIT DROP"
    )
    await conn.execute("INSERT INTO payout_once VALUES (1), (1)")


@pytest.mark.parametrize("breaks", [_aborted, _deferred_violation], ids=["aborted", "deferred"])
async def test_a_reconcilers_uncommittable_fenced_transaction_fails_and_the_run_goes_on(
    pg_store: Store, pool: Any, breaks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """It stopped every run at the oldest record for good (FencedSettlementRefused raised out
    of `reconcile_unknown`), the records behind it never reconciled."""
    await _unknown(pg_store, "broken", "fine-1", "fine-2")

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        conn = await ctx.fenced_connection()
        await conn.execute(LEDGER_INSERT, ctx.tenant, ctx.key, 1)
        if ctx.key == "broken":
            await breaks(conn)
        return Happened(201, b"{}", [(b"content-type", b"application/json")])

    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        report = await asyncio.wait_for(reconcile_unknown(pg_store, {OPERATION: reconciler}), 20)
    assert (report.examined, report.verdicts) == (3, {"failed": 1, "settled": 2})
    states = await _states(pg_store, "broken", "fine-1", "fine-2")
    assert states == [State.UNKNOWN, State.SUCCEEDED, State.SUCCEEDED]
    assert await count(pool, "test_ledger") == 2  # the broken one's write rolled back
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "reconciler's answer could not be recorded" in warning.getMessage()
    assert "broken" not in warning.getMessage()  # (the record's key, by its digest only)
    # The next run finds it again, and fails it again, without stopping.
    again = await asyncio.wait_for(reconcile_unknown(pg_store, {OPERATION: reconciler}), 20)
    assert (again.examined, again.verdicts) == (1, {"failed": 1})


async def test_a_clients_retry_is_told_outcome_unknown_when_the_answer_cannot_be_committed(
    pg_store: Store, pool: Any
) -> None:
    """It was answered `500 server-misconfigured`, as if the handler had failed to commit."""
    ran: list[int] = []

    async def swallows_an_error(ctx: ReconcileContext) -> Reconciliation:
        await _aborted(await ctx.fenced_connection())
        return Happened(201)

    async def lost(request: Request) -> JSONResponse:
        await request.body()
        ran.append(1)
        return JSONResponse({}, status_code=502)  # lease mode: the outcome is unknown

    handler = idempotent(mode=Mode.LEASE, reconciler=swallows_an_error)(lost)
    app = one_route_app("/payouts", handler, store=pg_store)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        for _ in range(2):
            retry = await asyncio.wait_for(c.post("/payouts", headers=HEADERS, json={}), 20)
            assert FAILED in assert_problem(retry, 409, "outcome-unknown")["detail"]
    assert ran == [1]
    assert await pool.fetchval("SELECT state FROM idem_requests") == "unknown"


async def test_a_refusal_at_the_settlement_fails_but_a_blip_is_still_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a refusal of the statement is the reconciler's: a lost connection (any other
    StoreError) is the store's failure, raised as before (a batch stops, a retry gets 503)."""
    from idem_middleware.store import MemoryStore

    store = MemoryStore()
    generation = (await _unknown(store, "k"))["k"]
    key = RecordKey("t", OPERATION, "k")

    async def happened(ctx: ReconcileContext) -> Reconciliation:
        return Happened(201)

    async def refused(self: Any, settlement: Settlement) -> bool:
        raise FencedSettlementRefused("the database refused it")

    monkeypatch.setattr(fence.Fence, "settle", refused)
    result = await run_reconciler(store, key, generation, happened, seconds=5)
    assert (result.verdict, result.reason) == (Verdict.FAILED, FAILED)

    async def lost(self: Any, settlement: Settlement) -> bool:
        raise StoreError("ConnectionDoesNotExistError: connection was closed")

    monkeypatch.setattr(fence.Fence, "settle", lost)
    with pytest.raises(StoreError) as raised:
        await run_reconciler(store, key, generation, happened, seconds=5)
    assert type(raised.value) is StoreError


async def test_a_reconcilers_http_status_member_is_recorded_as_its_number() -> None:
    """As a handler's: `Happened(HTTPStatus.CREATED)` was kept as the enum member it is."""
    from http import HTTPStatus

    from idem_middleware.store import MemoryStore

    store = MemoryStore()
    generation = (await _unknown(store, "k"))["k"]
    key = RecordKey("t", OPERATION, "k")

    async def happened(ctx: ReconcileContext) -> Reconciliation:
        return Happened(HTTPStatus.CREATED)

    result = await run_reconciler(store, key, generation, happened, seconds=5)
    assert result.verdict is Verdict.SETTLED
    record = await store.get(key)
    assert record is not None
    assert record.response is not None
    assert type(record.response.status) is int
    assert record.response.status == 201


async def test_a_stale_generation_that_is_not_its_own_fence_is_the_reconcilers_failure(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: a StaleGeneration the reconciler raised (a lease-mode job it called had
    lost its claim) was read as "the record changed": a client's retry read the record again
    and asked again, thousands of times, then answered a bare 500, and a batch counted it
    `changed` run after run, logging nothing. Only its own fence's refusal is a change."""
    from idem_middleware.errors import StaleGeneration

    generation = (await _unknown(store, "k"))["k"]
    key = RecordKey("t", OPERATION, "k")
    asked = 0

    async def calls_a_job_that_lost_its_claim(ctx: ReconcileContext) -> Reconciliation:
        nonlocal asked
        asked += 1
        raise StaleGeneration("the job's claim was lost")

    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        result = await run_reconciler(
            store, key, generation, calls_a_job_that_lost_its_claim, seconds=5
        )
    assert result.verdict is Verdict.FAILED
    assert asked == 1
    assert [r.getMessage() for r in caplog.records] == ["reconciler failed"]
    assert await _states(store, "k") == [State.UNKNOWN]

    async def its_own_fence_refused(ctx: ReconcileContext) -> Reconciliation:
        done = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
        assert await store.settle(key, generation, State.UNKNOWN, done)  # (an operator, say)
        await ctx.fenced_connection()  # (refused: the record changed under this generation)
        return Happened(201)

    changed = await run_reconciler(store, key, generation, its_own_fence_refused, seconds=5)
    assert changed.verdict is Verdict.CHANGED


async def test_a_hop_by_hop_header_in_a_happened_answer_is_dropped_not_refused(
    store: Store,
) -> None:
    """Found by probing: `Proxy-Connection`, which a replay never carries, was checked before
    it was dropped, and failed the whole reconciliation: the key stayed unknown for good."""
    generation = (await _unknown(store, "k"))["k"]
    key = RecordKey("t", OPERATION, "k")

    async def happened(ctx: ReconcileContext) -> Reconciliation:
        return Happened(
            201, body=b"{}", headers=[(b"proxy-connection", b"keep-alive"), (b"x-bank", b"1")]
        )

    result = await run_reconciler(store, key, generation, happened, seconds=5)
    assert result.verdict is Verdict.SETTLED
    record = await store.get(key)
    assert record is not None
    assert record.response is not None
    assert list(record.response.headers) == [(b"x-bank", b"1")]


# -- a CancelledError of the reconciler's own ------------------------------------------------------


async def _cancelled_elsewhere() -> None:
    """What a reconciler meets awaiting a shared lookup someone else cancelled."""
    lookup = asyncio.ensure_future(asyncio.sleep(10))
    asyncio.get_running_loop().call_soon(lookup.cancel)
    await lookup


async def test_a_reconcilers_own_cancelled_error_fails_and_the_run_goes_on(store: Store) -> None:
    """It ended the whole run with CancelledError, though nobody cancelled it."""
    await _unknown(store, "cancelled", "fine")

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        if ctx.key == "cancelled":
            await _cancelled_elsewhere()
        return Happened(201)

    report = ReconcileReport()
    await asyncio.wait_for(reconcile_unknown(store, {OPERATION: reconciler}, report=report), 20)
    assert (report.examined, report.verdicts) == (2, {"failed": 1, "settled": 1})
    assert await _states(store, "cancelled", "fine") == [State.UNKNOWN, State.SUCCEEDED]
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_clients_retry_is_told_outcome_unknown_when_its_reconciler_is_cancelled(
    store: Store,
) -> None:
    """The client's request died with the reconciler's CancelledError (no answer at all)."""

    async def raises_cancelled(ctx: ReconcileContext) -> Reconciliation:
        raise asyncio.CancelledError

    async def lost(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({}, status_code=502)

    handler = idempotent(mode=Mode.LEASE, reconciler=raises_cancelled)(lost)
    app = one_route_app("/payouts", handler, store=store)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        retry = await asyncio.wait_for(c.post("/payouts", headers=HEADERS, json={}), 20)
        assert FAILED in assert_problem(retry, 409, "outcome-unknown")["detail"]


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
async def test_a_cancellation_of_the_run_is_still_raised(store: Store, batch: bool) -> None:
    generation = (await _unknown(store, "k"))["k"]
    asking = asyncio.Event()

    async def slow(ctx: ReconcileContext) -> Reconciliation:
        await ctx.fenced_connection()  # (the fence is let go of when cancelled)
        asking.set()
        await asyncio.sleep(30)
        return Happened(201)

    key = RecordKey("t", OPERATION, "k")
    run = (
        reconcile_unknown(store, {OPERATION: slow})
        if batch
        else run_reconciler(store, key, generation, slow, seconds=30)
    )
    task = asyncio.ensure_future(run)
    await asyncio.wait_for(asking.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    record = await store.get(key)
    assert record is not None
    assert (record.state, record.generation) == (State.UNKNOWN, generation)
    # Its fence let go of the row: another reconciler's fence has it at once.
    result = await run_reconciler(store, key, generation, _happened, seconds=5)
    assert result.verdict is Verdict.SETTLED


async def _happened(ctx: ReconcileContext) -> Reconciliation:
    await ctx.fenced_connection()
    return Happened(201)


# -- the command line ------------------------------------------------------------------------------

FAULTS_APP = """
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, idempotent
from idem_middleware.reconcile import Happened


async def reconcile(ctx):
    conn = await ctx.fenced_connection()
    try:
        if ctx.key == "aborted":
            await conn.execute("SELECT 1/0")
        if ctx.key == "lost":
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    except Exception:
        pass
    return Happened(201)


@idempotent(mode=Mode.LEASE, reconciler=reconcile)
async def payouts(request):
    return JSONResponse({}, status_code=201)


app = Starlette(
    routes=[Route("/payouts", payouts, methods=["POST"])],
    middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
)
"""


def _reconcile(db_dsn: str, tmp_path: Path, *args: str) -> Any:
    (tmp_path / "faults_app.py").write_text(FAULTS_APP)
    path = os.pathsep.join([str(tmp_path), str(ROOT)])
    return cli("reconcile", "--app", "faults_app:app", *args, dsn=db_dsn, env={"PYTHONPATH": path})


async def test_cli_reconcile_goes_on_after_a_reconciler_whose_answer_cannot_be_committed(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    await insert(pool, "aborted", "unknown", age=20)  # the oldest: reconciled first
    await insert(pool, "fine", "unknown", age=10)
    result = _reconcile(db_dsn, tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdicts"] == {"failed": 1, "settled": 1}
    assert "reconciler's answer could not be recorded" in result.stderr
    assert "Traceback" not in result.stderr
    states = {r["idem_key"]: r["state"] for r in await pool.fetch("SELECT * FROM idem_requests")}
    assert states == {"aborted": "unknown", "fine": "succeeded"}


async def test_cli_reconcile_stopped_by_the_store_says_no_verdict_not_no_reconciler(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    """The reconciler ran (its fenced connection lost under it, a blip that stops the run): the
    message said "no reconciler ran"."""
    await insert(pool, "lost", "unknown", age=20)
    await insert(pool, "fine", "unknown", age=10)
    result = _reconcile(db_dsn, tmp_path)
    assert result.returncode == 1, result.stderr
    assert "reconcile stopped after examining 1 unknown records (no verdict reached)" in (
        result.stderr
    )
    assert "no reconciler ran" not in result.stderr
    states = {r["idem_key"]: r["state"] for r in await pool.fetch("SELECT * FROM idem_requests")}
    assert states == {"lost": "unknown", "fine": "unknown"}
