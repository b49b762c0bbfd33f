"""A reconciler's `Happened` is held to the policy's `max_response_bytes`, as a handler's
response is, and its audit line says what it did in an operator's move's form.

Found by an earlier hunt: a `Happened` body of any size was stored whole and replayed whole to
every retry for the record's retention (a handler's response over the cap is never stored). It
is refused now, loudly (an error in the log), and the record stays `unknown`: nothing is lost,
an operator (or a fixed reconciler) settles it. The audit line was a bare `reconciled`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse

from idem_middleware import Mode, idempotent
from idem_middleware.ops import reconcile_unknown
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from idem_middleware.store.base import RecordKey, State, Store
from tests.apps import client, one_route_app
from tests.integration.test_cli import cli, insert

HEADERS = {"idempotency-key": "k"}
KEY = RecordKey("tenant-a", "POST /payouts", "k")
CAP = 100
ROOT = Path(__file__).resolve().parents[2]


def _answering(size: int) -> Any:
    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        return Happened(201, b"x" * size)

    return reconciler


def _lost_answer_app(store: Store, reconciler: Any, **policy: Any) -> Any:
    """`POST /payouts`: its run's answer is lost (502: the record turns unknown)."""

    async def payout(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({}, status_code=502)

    handler = idempotent(mode=Mode.LEASE, reconciler=reconciler, **policy)(payout)
    return one_route_app("/payouts", handler, store=store)


def _trail(note: str | None) -> list[str]:
    return [line.split(" ", 1)[1] for line in (note or "").splitlines()]


async def _refused(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    summary = await store.describe(KEY)
    assert summary is not None
    assert summary.state is State.UNKNOWN  # nothing lost: left for an operator
    assert summary.response_status is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("over max_response_bytes (100)" in r.getMessage() for r in errors), caplog.text
    assert "xxxx" not in caplog.text  # (never the body)


async def test_a_retrys_happened_over_the_cap_is_refused(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    app = _lost_answer_app(store, _answering(CAP + 1), max_response_bytes=CAP)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        with caplog.at_level(logging.WARNING, logger="idem_middleware"):
            retry = await c.post("/payouts", headers=HEADERS, json={})
    assert retry.status_code == 409, retry.text  # (201 with the 101-byte body: stored)
    assert retry.json()["type"].endswith("outcome-unknown")
    await _refused(store, caplog)


async def test_a_retrys_happened_at_the_cap_is_stored_with_its_audit_line(store: Store) -> None:
    app = _lost_answer_app(store, _answering(CAP), max_response_bytes=CAP)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        retry = await c.post("/payouts", headers=HEADERS, json={})
    assert (retry.status_code, retry.content) == (201, b"x" * CAP)
    summary = await store.describe(KEY)
    assert summary is not None
    assert _trail(summary.note) == ["reconciled unknown -> succeeded 201"]  # (was "reconciled")


async def test_the_batchs_happened_over_the_cap_is_refused(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    app = _lost_answer_app(store, None)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        report = await reconcile_unknown(
            store, {KEY.operation: _answering(CAP + 1)}, max_response_bytes={KEY.operation: CAP}
        )
    assert report.verdicts == {"failed": 1}, report  # (settled: stored whole)
    await _refused(store, caplog)
    report = await reconcile_unknown(
        store, {KEY.operation: _answering(CAP)}, max_response_bytes={KEY.operation: CAP}
    )
    assert report.verdicts == {"settled": 1}, report
    summary = await store.describe(KEY)
    assert summary is not None
    assert _trail(summary.note) == ["reconciled unknown -> succeeded 201"]


async def test_the_batch_holds_an_operation_it_is_given_no_cap_for_to_the_default(
    store: Store,
) -> None:
    app = _lost_answer_app(store, None)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
    report = await reconcile_unknown(store, {KEY.operation: _answering(1024 * 1024 + 1)})
    assert report.verdicts == {"failed": 1}, report
    summary = await store.describe(KEY)
    assert summary is not None
    assert summary.state is State.UNKNOWN


@pytest.mark.parametrize("caps", ["a", [100], {"POST /payouts": -1}, {"POST /payouts": 1.5}])
async def test_the_batchs_caps_are_checked_before_anything_is_done(caps: Any) -> None:
    from idem_middleware import MemoryStore

    with pytest.raises((TypeError, ValueError), match=r"max_response_bytes (maps|of)"):
        await reconcile_unknown(MemoryStore(), {}, max_response_bytes=caps)


CAPPED_APP = """
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, idempotent
from idem_middleware.reconcile import Happened


async def reconcile(ctx):
    return Happened(201, b"x" * int(ctx.key))


@idempotent(mode=Mode.LEASE, reconciler=reconcile, max_response_bytes=100)
async def payouts(request):
    return JSONResponse({}, status_code=201)


app = Starlette(
    routes=[Route("/payouts", payouts, methods=["POST"])],
    middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
)
"""


async def test_cli_reconcile_holds_each_operation_to_its_policys_cap(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    (tmp_path / "capped_app.py").write_text(CAPPED_APP)
    await insert(pool, "101", "unknown", age=20)
    await insert(pool, "100", "unknown", age=10)
    path = os.pathsep.join([str(tmp_path), str(ROOT)])
    result = cli(
        "reconcile", "--app", "capped_app:app", "--json", dsn=db_dsn, env={"PYTHONPATH": path}
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdicts"] == {"failed": 1, "settled": 1}
    assert "over max_response_bytes (100)" in result.stderr
    rows = {r["idem_key"]: r for r in await pool.fetch("SELECT * FROM idem_requests")}
    assert rows["101"]["state"] == "unknown"
    assert rows["100"]["state"] == "succeeded"
    assert _trail(rows["100"]["note"]) == ["reconciled unknown -> succeeded 201"]
