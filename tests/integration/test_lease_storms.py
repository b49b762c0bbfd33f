"""Lease mode's recovery paths meeting each other on one key: a reconciler's verdict racing
another reconciler (a duplicate's, or `idem-middleware reconcile`'s), a takeover, an operator's
move, and storms of duplicates of many keys whose leases lapse at once under a tenant cap.

The route is tests/apps/lease.py's `POST /payouts` (its "bank" deduplicates by downstream key).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import asyncpg
import httpx
import pytest

from idem_middleware import PostgresStore, RecordKey
from idem_middleware.fence import Verdict, run_reconciler
from idem_middleware.reconcile import ReconcileContext, Reconciliation, StillUnknown
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
    wait_for_lock_waiters,
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
    the other reconciler ran, however long)."""
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
                await wait_for_lock_waiters(bank)  # its takeover, on the other's fence
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
