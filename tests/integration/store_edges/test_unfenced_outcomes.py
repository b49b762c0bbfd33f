"""Lease-mode outcomes the store writes without a fence (a handler that opened no fenced
connection, a job, a reconciler's verdict), refused or skipped by the server (a constraint or
trigger an operator added to `idem_requests`):

- refused: `500 server-misconfigured` as a problem document naming it, and the record
  `unknown`. The driver's error escaped: the app's bare 500, and a lease job's record left
  `pending`, so that a TAKEOVER ran the job again once the lease lapsed;
- skipped (the write changed nothing, a BEFORE trigger returning NULL): a retry's reconciler was
  asked again and again for the same record, ten thousand times in one retry, then a bare 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import LeaseExpiry, Mode, Policy, PostgresStore
from idem_middleware.errors import SettlementRefused
from idem_middleware.jobs import idempotent_job
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from tests.apps import client, key, one_route_app
from tests.integration.store_edges.lapsed import lapsed_record

_CHECK = "operator_no_success_yet"
_UNDO = (
    f"ALTER TABLE idem_requests DROP CONSTRAINT IF EXISTS {_CHECK};"
    "DROP TRIGGER IF EXISTS swallow ON idem_requests; DROP FUNCTION IF EXISTS swallow()"
)


async def send(request: Request) -> Response:
    return JSONResponse({"sent": True}, status_code=201)  # (no fenced connection)


@pytest.fixture
async def admin(db_dsn: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(_UNDO)
        yield conn
    finally:
        await conn.execute(_UNDO)
        await conn.close()


async def _state(admin: asyncpg.Connection[Any], name: str) -> str | None:
    state: str | None = await admin.fetchval(
        "SELECT state FROM idem_requests WHERE idem_key = $1", name
    )
    return state


async def test_a_refused_unfenced_settlement_is_a_problem_and_unknown(
    db_dsn: str, admin: asyncpg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    await admin.execute(
        f"ALTER TABLE idem_requests ADD CONSTRAINT {_CHECK} CHECK (state <> 'succeeded') NOT VALID"
    )
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    policy = Policy(mode=Mode.LEASE)
    async with store, client(one_route_app("/send", send, store=store, default_policy=policy)) as c:
        r = await c.post("/send", json={}, headers=key("unfenced-refused"))
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("server-misconfigured")
    assert await _state(admin, "unfenced-refused") == "unknown"
    assert _CHECK in caplog.text


async def test_a_lease_jobs_refused_settlement_leaves_its_record_unknown(
    db_dsn: str, admin: asyncpg.Connection[Any]
) -> None:
    """Left pending, its lease lapsed and a redelivery took it over: the job ran twice."""
    await admin.execute(
        f"ALTER TABLE idem_requests ADD CONSTRAINT {_CHECK} CHECK (state <> 'succeeded') NOT VALID"
    )
    runs: list[str] = []
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False) as store:

        @idempotent_job(
            store, operation="emails.send", key="k", mode=Mode.LEASE,
            on_lease_expiry=LeaseExpiry.TAKEOVER,
        )  # fmt: skip
        async def email(job: Any, *, k: str) -> dict[str, str]:
            runs.append(k)
            return {"sent": k}

        with pytest.raises(SettlementRefused, match=_CHECK):
            await email(k="refused-job")
    assert runs == ["refused-job"]
    assert await admin.fetchval(
        "SELECT state FROM idem_requests WHERE operation = 'emails.send' AND idem_key = $1",
        "refused-job",
    ) == "unknown"  # (no takeover: that is for a lapsed pending record)  # fmt: skip


async def test_a_reconciled_settlement_that_lands_nowhere_is_asked_a_few_times(
    db_dsn: str, admin: asyncpg.Connection[Any]
) -> None:
    asked: list[int] = []

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        asked.append(ctx.generation)
        return Happened.json(201, {"sent": True})

    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    policy = Policy(mode=Mode.LEASE, reconciler=reconciler)
    name = "reconciled-nowhere"
    async with store, client(one_route_app("/pay", send, store=store, default_policy=policy)) as c:
        await lapsed_record(c, store, admin, name)
        await admin.execute(
            "UPDATE idem_requests SET state = 'unknown', lease_expires_at = NULL"
            " WHERE idem_key = $1",
            name,
        )
        await admin.execute(
            "CREATE FUNCTION swallow() RETURNS trigger LANGUAGE plpgsql"
            " AS 'BEGIN RETURN NULL; END';"
            "CREATE TRIGGER swallow BEFORE UPDATE ON idem_requests FOR EACH ROW"
            " EXECUTE FUNCTION swallow()"
        )
        r = await c.post("/pay", json={}, headers=key(name))
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert 1 <= len(asked) <= 3  # (was: until the wait ran out, about 10,000 calls)
    assert await _state(admin, name) == "unknown"
