"""A reconciler that swallows its cancellation (catches CancelledError and keeps awaiting) made
`reconcile_timeout_seconds` (and `reconcile_unknown`'s `seconds`) a lie: the batch, and the
client's retry that asked it, hung until it ended, for good if it never does. Past its bound and a
short grace it is now abandoned: an ERROR names it and the record's digest, the verdict is
`failed` (the record stays unknown), and the batch (or the retry) goes on. The abandoned run keeps
its fence until it ends (other reconcilers find the record held), a late `Happened` is settled
under its generation (its fence held the row all along), and only so many may pile up."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse

from idem_middleware import Mode, idempotent, ops, reconcile_bound
from idem_middleware.fence import Verdict
from idem_middleware.ops import ReconcileReport, reconcile_unknown
from idem_middleware.reconcile import Happened, NotHappened, ReconcileContext, Reconciliation
from idem_middleware.reconcile_bound import ReconcilersStuck
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, Store, StoredResponse
from tests.apps import LEDGER_INSERT, assert_problem, client, count, one_route_app
from tests.integration.test_cli import insert

ROOT = Path(__file__).resolve().parents[2]

OPERATION = "POST /payouts"
HEADERS = {"idempotency-key": "stubborn"}
#: The longest any call under test may take before the test fails (a hang fails, never hangs).
BOUND = 6.0
#: The longest a stubborn reconciler runs on its own (bounded: every loop ends).
STUBBORN_FOR = 12.0


class Stubborn:
    """A reconciler that swallows every cancellation until `release` (or `STUBBORN_FOR`), then
    answers `answer`; with `fenced`, it first writes a ledger row in its fenced transaction."""

    def __init__(self, answer: Reconciliation | None = None, *, fenced: bool = False) -> None:
        self.release = asyncio.Event()
        self.answer = answer if answer is not None else NotHappened()
        self.fenced = fenced
        self.cancels = 0
        self.fenced_runs = 0  # (those whose fence was not refused: the record was not held)
        self.started = 0
        self.ended = 0

    async def __call__(self, ctx: ReconcileContext) -> Reconciliation:
        self.started += 1
        try:
            if self.fenced:
                conn = await ctx.fenced_connection()
                self.fenced_runs += 1
                await conn.execute(LEDGER_INSERT, ctx.tenant, ctx.key, 1)
            loop = asyncio.get_running_loop()
            end = loop.time() + STUBBORN_FOR
            while not self.release.is_set() and loop.time() < end:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    self.cancels += 1  # swallowed: keeps going
            return self.answer
        finally:
            self.ended += 1


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


async def _state(store: Store, name: str, tenant: str = "t") -> State | None:
    record = await store.get(RecordKey(tenant, OPERATION, name))
    return None if record is None else record.state


async def _within(coro: Any, seconds: float = BOUND) -> Any:
    """`coro`'s result if it ends within `seconds`; else the test fails (its task is left
    running: a stubborn reconciler would keep `wait_for`'s cancellation waiting too)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        pytest.fail(f"did not end within {seconds} s (hangs on a stubborn reconciler)")
    return task.result()


async def _settle_down(*stubborn: Stubborn) -> None:
    """Release the stubborn reconcilers and wait (bounded) for their runs to end."""
    for one in stubborn:
        one.release.set()
    for _ in range(int(STUBBORN_FOR * 100) + 200):
        if all(one.ended == one.started for one in stubborn):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # (their runs seal their fences after the reconciler returns)


@pytest.fixture
async def stubborn() -> AsyncIterator[list[Stubborn]]:
    made: list[Stubborn] = []
    try:
        yield made
    finally:
        await _settle_down(*made)


async def test_the_batch_goes_on_past_a_reconciler_that_swallows_its_cancellation(
    pg_store: Store, stubborn: list[Stubborn], caplog: pytest.LogCaptureFixture
) -> None:
    await _unknown(pg_store, "stuck", "fine")
    stuck = Stubborn()
    stubborn.append(stuck)

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        if ctx.key == "stuck":
            return await stuck(ctx)
        return Happened(201, b"{}")

    caplog.set_level(logging.INFO, logger="idem_middleware")
    report = await _within(reconcile_unknown(pg_store, {OPERATION: reconciler}, seconds=0.3))
    assert report.verdicts == {"failed": 1, "settled": 1}
    assert stuck.cancels >= 1
    assert await _state(pg_store, "stuck") is State.UNKNOWN
    assert await _state(pg_store, "fine") is State.SUCCEEDED
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    assert "reconciler" in errors[0].getMessage()
    assert getattr(errors[0], "key_digest", None)
    assert "stuck" not in errors[0].getMessage()  # (never the raw key)


def _lost_payout(store: Store, reconciler: Any, timeout: float = 0.3) -> tuple[Any, list[int]]:
    """`POST /payouts`: its first run's answer is lost (502: unknown), later ones pay (201)."""
    runs: list[int] = []

    async def payout(request: Request) -> JSONResponse:
        await request.body()
        runs.append(1)
        return JSONResponse({"run": len(runs)}, status_code=502 if len(runs) == 1 else 201)

    options = {"reconcile_timeout_seconds": timeout, "wait_seconds": 1.0}
    handler = idempotent(mode=Mode.LEASE, reconciler=reconciler, **options)(payout)
    return one_route_app("/payouts", handler, store=store), runs


async def test_a_clients_retry_is_answered_past_a_reconciler_that_swallows_its_cancellation(
    pg_store: Store, stubborn: list[Stubborn]
) -> None:
    stuck = Stubborn()
    stubborn.append(stuck)
    app, runs = _lost_payout(pg_store, stuck)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        retry = await _within(c.post("/payouts", headers=HEADERS, json={}))
    problem = assert_problem(retry, 409, "outcome-unknown")
    assert "failed" in problem["detail"]
    assert runs == [1]  # (its late "not happened" runs nothing again)
    assert await _state(pg_store, "stubborn", "tenant-a") is State.UNKNOWN


STUBBORN_APP = """
import asyncio

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, idempotent
from idem_middleware.reconcile import Happened


async def reconcile(ctx):
    if ctx.key.startswith("stuck"):
        await ctx.fenced_connection()
        loop = asyncio.get_running_loop()
        end = loop.time() + 30  # (bounded: the test's subprocess timeout is shorter)
        while loop.time() < end:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
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


def _cli_reconcile(db_dsn: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`idem-middleware reconcile --app stubborn_app:app ...`: a hang fails (TimeoutExpired)."""
    (tmp_path / "stubborn_app.py").write_text(STUBBORN_APP)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "IDEM_DATABASE_URL")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    command = [sys.executable, "-m", "idem_middleware.cli", "--dsn", db_dsn, "reconcile"]
    return subprocess.run(
        [*command, "--app", "stubborn_app:app", *args],
        capture_output=True,
        text=True,
        timeout=15,
        env=env,
    )


async def test_cli_reconcile_ends_past_a_reconciler_that_swallows_its_cancellation(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    """The command hung for good: its batch on the reconciler, then (the report printed) its
    exit, on the abandoned run's connection and task. Its pool has two connections: past one
    abandoned run (holding one), the batch stops and says why, never on "no database
    connection" with both held. It exits 1: the report stands, but an operator must look."""
    for n, name in enumerate(["stuck-1", "stuck-2", "fine"]):
        await insert(pool, name, "unknown", age=30 - n)  # (reconciled in this order)
    args = ("--json", "--seconds", "0.3")
    result = await asyncio.to_thread(_cli_reconcile, db_dsn, tmp_path, *args)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert json.loads(result.stdout)["verdicts"] == {"failed": 1}
    assert "did not end within its grace" in result.stderr
    assert "reconcile stopped after" in result.stderr
    assert "1 reconciler runs that ignored their cancellation are still running" in result.stderr
    assert "no database connection" not in result.stderr
    assert "1 reconciler runs ignored their cancellation and still run: exiting" in result.stderr
    states = {r["idem_key"]: r["state"] for r in await pool.fetch("SELECT * FROM idem_requests")}
    assert states == {"stuck-1": "unknown", "stuck-2": "unknown", "fine": "unknown"}
    # (Its fenced transaction rolled back with the process: the next run finds nothing held.)
    assert (
        await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in%'")
        == 0
    )


async def _until(check: Any, seconds: float = BOUND) -> None:
    """Wait (bounded) until `check()` is true."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not check():
        assert loop.time() < end, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_an_abandoned_run_keeps_its_fence_and_its_late_happened_is_settled(
    pg_store: Store, pool: Any, stubborn: list[Stubborn]
) -> None:
    """Abandoned, its fenced transaction (a ledger row written in it) is kept until it ends:
    another batch finds the record held meanwhile and asks nobody. Its late `Happened` is then
    settled with its ledger row, under the generation it was asked about (its fence held the
    row all along: nothing else moved it)."""
    await _unknown(pg_store, "stuck")
    stuck = Stubborn(Happened(201, b'{"paid": 1}'), fenced=True)
    stubborn.append(stuck)
    report = await _within(reconcile_unknown(pg_store, {OPERATION: stuck}, seconds=0.3))
    assert report.verdicts == {"failed": 1}
    assert await _state(pg_store, "stuck") is State.UNKNOWN
    assert await count(pool, "test_ledger") == 0  # (not committed: still in its fence)
    asked: list[str] = []

    async def other(ctx: ReconcileContext) -> Reconciliation:
        await ctx.fenced_connection()
        asked.append(ctx.key)  # pragma: no cover - the record is held
        return NotHappened()  # pragma: no cover

    again = await _within(reconcile_unknown(pg_store, {OPERATION: other}, seconds=0.3))
    assert (again.held, again.verdicts, asked) == (1, {}, [])
    stuck.release.set()
    record = RecordKey("t", OPERATION, "stuck")
    await _until(lambda: stuck.ended == 1)
    for _ in range(200):  # (its run settles once the reconciler returned)
        if await _state(pg_store, "stuck") is State.SUCCEEDED:
            break
        await asyncio.sleep(0.02)
    found = await pg_store.get(record)
    assert found is not None
    assert found.state is State.SUCCEEDED
    assert found.response is not None
    assert found.response.body == b'{"paid": 1}'
    assert await count(pool, "test_ledger") == 1
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
        )
        == 0
    )


async def test_a_late_happened_after_the_record_moved_is_refused(
    pg_store: Store, stubborn: list[Stubborn], caplog: pytest.LogCaptureFixture
) -> None:
    """Abandoned without a fence, its record resolved by an operator meanwhile: the late
    `Happened` changes nothing (a compare-and-set under the generation it was asked about)."""
    await _unknown(pg_store, "stuck")
    stuck = Stubborn(Happened(201, b"late"))
    stubborn.append(stuck)
    report = await _within(reconcile_unknown(pg_store, {OPERATION: stuck}, seconds=0.3))
    assert report.verdicts == {"failed": 1}
    record = RecordKey("t", OPERATION, "stuck")
    response = StoredResponse(402, [(b"content-type", b"text/plain")], b"operator")
    await ops.resolve(pg_store, record, "failed_final", note="by hand", response=response)
    caplog.set_level(logging.INFO, logger="idem_middleware")
    stuck.release.set()
    await _until(lambda: "abandoned reconciler run ended" in caplog.text)
    assert "abandoned reconciler run ended: changed" in caplog.text
    found = await pg_store.get(record)
    assert found is not None
    assert found.state is State.FAILED_FINAL
    assert found.response is not None
    assert found.response.body == b"operator"


async def test_abandoned_runs_are_bounded_then_the_batch_stops_and_says_why(
    pg_store: Store, stubborn: list[Stubborn], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconcile_bound, "MAX_ABANDONED", 2)
    await _unknown(pg_store, "stuck-1", "stuck-2", "stuck-3", "fine")
    stuck = Stubborn()
    stubborn.append(stuck)

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        if ctx.key.startswith("stuck"):
            return await stuck(ctx)
        return Happened(201)  # pragma: no cover - the batch stops before it

    report = ReconcileReport()
    with pytest.raises(ReconcilersStuck, match="2 reconciler runs that ignored"):
        await _within(
            reconcile_unknown(pg_store, {OPERATION: reconciler}, seconds=0.2, report=report)
        )
    assert report.verdicts == {"failed": 2}
    assert stuck.started == 2  # (the third is not asked)
    assert reconcile_bound.abandoned() == 2
    # A client's retry is told its reconciler failed, without asking it (no third run).
    assert (
        await _within(
            reconcile_bound.bounded_reconciler(
                pg_store, RecordKey("t", OPERATION, "stuck-3"), 1, stuck, seconds=0.2
            )
        )
    ).verdict is Verdict.FAILED
    assert stuck.started == 2
    await _settle_down(stuck)
    assert reconcile_bound.abandoned() == 0


async def test_a_cancelled_caller_is_not_kept_by_a_reconciler_that_swallows_it(
    pg_store: Store, stubborn: list[Stubborn]
) -> None:
    """The batch (or the client's request) cancelled while its reconciler runs: the
    cancellation ends it within the grace, whatever the reconciler makes of its own."""
    await _unknown(pg_store, "stuck")
    stuck = Stubborn()
    stubborn.append(stuck)
    task = asyncio.ensure_future(reconcile_unknown(pg_store, {OPERATION: stuck}, seconds=5))
    await _until(lambda: stuck.started == 1)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=3)
    assert done, "the cancelled batch hung on its reconciler"
    assert task.cancelled()
    assert await _state(pg_store, "stuck") is State.UNKNOWN


async def test_a_retry_while_an_abandoned_run_holds_the_fence_is_answered(
    pg_store: Store, stubborn: list[Stubborn]
) -> None:
    """The first retry's reconciler is abandoned holding its fence: a second retry finds the
    record held (as for any fence held elsewhere), never asks, and is answered within its
    wait; a retry whose client leaves is not kept either."""
    stuck = Stubborn(fenced=True)
    stubborn.append(stuck)
    app, runs = _lost_payout(pg_store, stuck)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        first = await _within(c.post("/payouts", headers=HEADERS, json={}))
        assert_problem(first, 409, "outcome-unknown")
        second = await _within(c.post("/payouts", headers=HEADERS, json={}), 40)
        # (Its reconciler was called, and its fence refused: the record is held.)
        assert_problem(second, 409, "request-in-flight")
        assert stuck.fenced_runs == 1
        # A retry whose client leaves (its request cancelled) is not kept either.
        stuck.release.set()
        await _until(lambda: stuck.ended == stuck.started)
        again = Stubborn()
        stubborn.append(again)
        app2, _ = _lost_payout(pg_store, again, timeout=5)
        async with client(app2) as c2:
            leaving = asyncio.ensure_future(c2.post("/payouts", headers=HEADERS, json={}))
            await _until(lambda: again.started == 1)
            leaving.cancel()
            done, _ = await asyncio.wait({leaving}, timeout=3)
            assert done, "the request whose client left hung on its reconciler"
    assert runs == [1]


async def test_a_reconciler_that_answered_in_time_is_not_abandoned_while_it_is_settled(
    pg_store: Store, pool: Any
) -> None:
    """Only the reconciler is bounded: its answer's settlement (a commit slower than the grace,
    here a deferred trigger's) is the store's move, bounded by the store, and waited for."""
    await _unknown(pg_store, "slow-commit")

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        conn = await ctx.fenced_connection()
        await conn.execute(
            "CREATE TEMP TABLE slow_commit (x int) ON COMMIT DROP;"
            "CREATE FUNCTION pg_temp.slow() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_sleep(0.8); RETURN NULL; END $$;"
            "CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON slow_commit"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pg_temp.slow();"
            "INSERT INTO slow_commit VALUES (1)"
        )
        return Happened(201)

    report = await _within(reconcile_unknown(pg_store, {OPERATION: reconciler}, seconds=0.3))
    assert report.verdicts == {"settled": 1}
    assert await _state(pg_store, "slow-commit") is State.SUCCEEDED
