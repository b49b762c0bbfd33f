"""The operator's batch commands when the database server stops partway, and two of them at once.

`purge` and `reconcile` are stopped by a fast shutdown of a server of this module's own
(tests/restarts.py) at a chosen point of their run (after a batch commits, inside a reconciler),
so nothing here depends on timing. Each must exit 1 with one line saying what it did before the
failure, leave nothing half done, and finish the job when run again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idem_middleware import Policy, PostgresStore, cli_commands, cli_reconcile, idempotent
from idem_middleware.policy import Mode
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from idem_middleware.reconcile_batch import reconcile_unknown
from tests.apps import trail
from tests.restarts import OwnServer

RECORDS = 50
OPERATION = "POST /payouts"


@pytest.fixture
async def own_store(own_dsn: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(dsn=own_dsn, min_size=1, max_size=4) as store:
        yield store


async def _fill(dsn: str, state: str, n: int) -> None:
    """`n` lease-mode records: expired finished ones, or unknown ones oldest first."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode,"
            " retention, expires_at, response_status, updated_at)"
            " SELECT 't', $1, 'k' || lpad(i::text, 5, '0'), '\\x00', $2, 'lease',"
            " interval '1 day',"
            " CASE WHEN $2 = 'succeeded' THEN now() - interval '1 hour' END,"
            " CASE WHEN $2 = 'succeeded' THEN 201 END,"
            " now() - make_interval(secs => 1000 - i)"
            " FROM generate_series(1, $3::int) i",
            OPERATION,
            state,
            n,
        )
    finally:
        await conn.close()


async def _states(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT state, count(*) AS n FROM idem_requests GROUP BY state")
    finally:
        await conn.close()
    return {r["state"]: r["n"] for r in rows}


class _StopsAfter:
    """A store whose purge stops the server once `batches` batches have committed."""

    def __init__(self, store: PostgresStore, server: OwnServer, batches: int) -> None:
        self.store, self.server, self.batches = store, server, batches

    async def purge(self, *, progress: Any, **limits: Any) -> int:
        seen = [0]

        def each(deleted: int) -> None:
            progress(deleted)
            seen[0] += 1
            if seen[0] == self.batches:
                self.server.stop()  # (blocks the loop: nothing of ours runs meanwhile)

        return await self.store.purge(progress=each, **limits)


def _purge_args(*, json: bool = False) -> argparse.Namespace:
    return argparse.Namespace(command="purge", json=json, batch_size=10, max_batches=1000)


@pytest.mark.parametrize("as_json", [False, True])
async def test_a_purge_the_server_stops_says_what_it_deleted_and_a_rerun_finishes(
    own_server: OwnServer,
    own_dsn: str,
    own_store: PostgresStore,
    as_json: bool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It exited 1 with the driver's message alone: how many records the committed batches had
    deleted was lost."""
    await _fill(own_dsn, "succeeded", RECORDS)
    store: Any = _StopsAfter(own_store, own_server, batches=3)
    with pytest.raises(cli_commands.Interrupted) as stopped:
        await cli_commands.purge(store, _purge_args(json=as_json))
    message = str(stopped.value)
    assert message.startswith("purge stopped after deleting 30 expired records"), message
    assert "\n" not in message
    if as_json:
        report = json.loads(capsys.readouterr().out)
        assert (report["purged"], report["stopped_at_limit"]) == (30, False)
        assert report["error"]
    await asyncio.to_thread(own_server.start)
    assert await _states(own_dsn) == {"succeeded": RECORDS - 30}  # the batches committed
    capsys.readouterr()
    assert await cli_commands.purge(own_store, _purge_args()) == 0
    assert capsys.readouterr().out == f"purged {RECORDS - 30} expired records\n"
    assert await _states(own_dsn) == {}


# -- reconcile ------------------------------------------------------------------------------------

#: What the module's reconciler does on its next calls: "stop" stops the server first.
PLAN: list[str] = []
SERVER: list[OwnServer] = []


async def _reconciler(ctx: ReconcileContext) -> Reconciliation:
    if PLAN and PLAN.pop(0) == "stop":
        SERVER[0].stop()
    return Happened(status=201, body=b"{}", headers=[(b"content-type", b"application/json")])


@idempotent(Policy(mode=Mode.LEASE, reconciler=_reconciler))
async def _payouts(request: Request) -> Response:
    return Response(status_code=201)


APP = Starlette(routes=[Route("/payouts", _payouts, methods=["POST"])])


def _reconcile_args(**more: Any) -> argparse.Namespace:
    options = {
        "command": "reconcile",
        "json": False,
        "app": f"{__name__}:APP",
        "tenant": None,
        "operation": None,
        "limit": 100,
        "seconds": 10.0,
        "lifespan": False,
    }
    return argparse.Namespace(**{**options, **more})


async def test_a_reconcile_the_server_stops_says_what_it_settled_and_a_rerun_finishes(
    own_server: OwnServer,
    own_dsn: str,
    own_store: PostgresStore,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The server stops while the third reconciler runs: the two settled records stay settled,
    the third stays unknown (its settlement never reached the database), the command says what
    it did before it failed, and the next run settles the rest. The report was lost."""
    await _fill(own_dsn, "unknown", 5)
    PLAN[:] = ["ok", "ok", "stop"]
    SERVER[:] = [own_server]
    with pytest.raises(cli_commands.Interrupted) as stopped:
        await cli_reconcile.reconcile(own_store, _reconcile_args())
    message = str(stopped.value)
    assert message.startswith(
        "reconcile stopped after examining 3 unknown records (settled 2) and turning 0 lapsed "
        "leases unknown"
    ), message
    await asyncio.to_thread(own_server.start)
    assert await _states(own_dsn) == {"succeeded": 2, "unknown": 3}
    capsys.readouterr()
    assert await cli_reconcile.reconcile(own_store, _reconcile_args(json=True)) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["examined"], report["verdicts"]) == (3, {"settled": 3})
    assert await _states(own_dsn) == {"succeeded": 5}


# -- two at once ---------------------------------------------------------------------------------


async def test_two_purges_at_once_share_the_work(own_dsn: str, own_store: PostgresStore) -> None:
    """Each batch skips the rows another one holds: together they delete every record once,
    neither waits on the other, neither fails."""
    await _fill(own_dsn, "succeeded", 2000)
    async with PostgresStore(dsn=own_dsn, min_size=1, max_size=2) as other:
        first, second = await asyncio.wait_for(
            asyncio.gather(
                own_store.purge(batch_size=7, max_batches=1000),
                other.purge(batch_size=7, max_batches=1000),
            ),
            timeout=60,
        )
    assert first + second == 2000
    assert await _states(own_dsn) == {}


async def test_two_reconciles_at_once_settle_each_record_once(
    own_dsn: str, own_store: PostgresStore
) -> None:
    """Both list the same unknown records; each record is settled by one of them, the other
    finds it changed (or held, passed over): no record settled twice, no error, no wait for
    the other run to end."""
    await _fill(own_dsn, "unknown", 40)
    calls: dict[str, int] = {}

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        calls[ctx.key] = calls.get(ctx.key, 0) + 1
        conn = await ctx.fenced_connection()  # the fenced transaction: the record's row is held
        await conn.execute("SELECT 1")
        await asyncio.sleep(0)
        return Happened(status=201, body=b"", headers=[])

    async with PostgresStore(dsn=own_dsn, min_size=1, max_size=4) as other:
        reports = await asyncio.wait_for(
            asyncio.gather(
                reconcile_unknown(own_store, {OPERATION: reconciler}, limit=100),
                reconcile_unknown(other, {OPERATION: reconciler}, limit=100),
            ),
            timeout=120,
        )
    settled = sum(r.verdicts.get("settled", 0) for r in reports)
    assert settled == 40
    assert not any(r.verdicts.get("failed") for r in reports)
    assert await _states(own_dsn) == {"succeeded": 40}
    conn = await asyncpg.connect(own_dsn)
    try:
        notes = await conn.fetch("SELECT note FROM idem_requests")
    finally:
        await conn.close()
    assert all(trail(r["note"])[-1] == "reconciled unknown -> succeeded 201" for r in notes)


async def _fenced_reconciler(ctx: ReconcileContext) -> Reconciliation:
    """The documented shape: ask the downstream service, then write in the fenced transaction."""
    if PLAN and PLAN.pop(0) == "stop":
        SERVER[0].stop()
    conn = await ctx.fenced_connection()
    await conn.execute("SELECT 1")
    return Happened(status=201, body=b"{}", headers=[(b"content-type", b"application/json")])


@idempotent(Policy(mode=Mode.LEASE, reconciler=_fenced_reconciler))
async def _fenced_payouts(request: Request) -> Response:
    return Response(status_code=201)


FENCED_APP = Starlette(routes=[Route("/payouts", _fenced_payouts, methods=["POST"])])


@pytest.mark.parametrize("as_json", [False, True])
async def test_a_reconcile_whose_fence_meets_a_stopped_server_stops_and_says_so(
    own_server: OwnServer,
    own_dsn: str,
    own_store: PostgresStore,
    as_json: bool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found by probing: the server stopped while the third reconciler asked its downstream
    service; its fenced connection could not be had, and the run counted that record `failed`
    (as if the reconciler had failed), then went through every remaining record, each failing
    the same way, and exited 0 ("failed: 3"): an outage of the store reported as three
    reconcilers' bugs. The run now stops at the outage, exits 1 saying so, and counts no
    reconciler failed; the records it did not settle stay unknown for the next run."""
    await _fill(own_dsn, "unknown", 5)
    PLAN[:] = ["ok", "ok", "stop"]
    SERVER[:] = [own_server]
    with pytest.raises(cli_commands.Interrupted) as stopped:
        await cli_reconcile.reconcile(
            own_store, _reconcile_args(app=f"{__name__}:FENCED_APP", json=as_json)
        )
    message = str(stopped.value)
    assert message.startswith(
        "reconcile stopped after examining 3 unknown records (settled 2) and turning 0 lapsed "
        "leases unknown"
    ), message
    if as_json:
        report = json.loads(capsys.readouterr().out)
        assert report["verdicts"] == {"settled": 2}
        assert report["error"]
    await asyncio.to_thread(own_server.start)
    assert await _states(own_dsn) == {"succeeded": 2, "unknown": 3}
