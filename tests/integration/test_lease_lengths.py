"""Lease lengths in lease mode (docs/lease-mode.md): a takeover that waited on the row lock, and
the executions it must never let overlap.

The helpers (the scripted `POST /payouts` app, `row`, `spawn` ...) are test_lease_mode.py's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import LeaseExpiry, PostgresStore
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    Step,
    assert_problem,
    build_lease_app,
    client,
    downstream_rows,
    lock_waiters,
    wait_for_waiters,
)
from tests.integration.test_lease_mode import (
    PausedHeartbeatStore,
    bank,  # noqa: F401 (a fixture)
    finish,
    lease_lapsed,
    post,
    probe_of,
    row,
    spawn,
)

pytestmark = pytest.mark.db_routes("pgbouncer")


class HeldSettlementStore(PausedHeartbeatStore):
    """A's store: its heartbeats never reach the database, and its settlements (the `unknown` it
    marks once its handler failed) wait for `release`. A's rollback lets the row go to B's
    waiting takeover and to A's own marking at once, and either may take it first (both are
    safe: one execution at a time); the test needs B's."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.release = asyncio.Event()

    async def settle(self, *args: Any, **kwargs: Any) -> bool:
        await asyncio.wait_for(self.release.wait(), BOUND)
        return await super().settle(*args, **kwargs)


async def test_a_takeover_that_waited_on_the_row_lock_gets_a_whole_lease(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    """A holds its fenced transaction past its lease; B's takeover waits for A's row lock for
    longer than a lease, and gets it when A's handler fails (its transaction rolls back). B's
    lease was counted from the start of its statement, before the wait: it had lapsed before B
    ran a line, and C took the record over while B still ran (two executions at once). A lease
    now starts when the takeover holds the lock: C waits, and B's outcome is the one recorded.
    (B's takeover no longer waits inside PostgreSQL: it finds the row held, waits in the process
    without a connection, and tries again.)"""
    lease = 0.6
    policy = LEASE_POLICY.replace(
        lease_seconds=lease, wait_seconds=3.0, on_lease_expiry=LeaseExpiry.TAKEOVER
    )
    async with HeldSettlementStore(pool=pool, listen=False) as paused:
        app_a = build_lease_app(paused, bank, policy)
        app_b = build_lease_app(pg_store, bank, policy)
        app_c = build_lease_app(pg_store, bank, policy.replace(wait_seconds=0.3))
        probe_a, probe_b, probe_c = probe_of(app_a), probe_of(app_b), probe_of(app_c)
        gate_a, gate_b = asyncio.Event(), asyncio.Event()
        probe_a.steps = [Step(fence="before", gate=gate_a, fail="late")]
        probe_b.steps = [Step(gate=gate_b)]
        async with client(app_a) as ca, client(app_b) as cb, client(app_c) as cc:
            task_a = spawn(post(ca))
            await asyncio.wait_for(probe_a.entered.wait(), BOUND)
            await lease_lapsed(bank)

            task_b = spawn(post(cb))
            await wait_for_waiters(app_b)  # B's takeover found A's row lock held
            assert await lock_waiters(bank) == 0  # B waits without a connection
            await asyncio.sleep(lease * 1.5)  # B waits longer than a whole lease
            gate_a.set()  # A fails: its fenced transaction rolls back, B's takeover goes on
            await asyncio.wait_for(probe_b.entered.wait(), BOUND)
            paused.release.set()  # A marks its record unknown: refused, B's generation holds it
            a = await finish(task_a)
            taken = await row(bank)
            assert taken is not None
            assert taken["generation"] == probe_b.contexts[0].generation
            assert taken["lease_live"], "B's lease lapsed before B ran (counted before its wait)"

            c = await asyncio.wait_for(post(cc), BOUND)
            assert_problem(c, 409, "request-in-flight")
            assert probe_c.calls == 0, "C took over while B was running"
            gate_b.set()
            b = await finish(task_b)
    assert_problem(a, 409, "request-in-flight")  # A's record was B's by then
    assert b.status_code == 201, b.text
    assert b.json()["generation"] == taken["generation"]
    assert await downstream_rows(bank) == 1
