"""Lease mode's heartbeat around the executor's own fenced transaction (docs/lease-mode.md):
a handler that opens its fence and then waits on a slow downstream call, past its lease.

The route is `POST /payouts` (tests/apps/lease.py), scripted by a `Step`; every wait ends on a
condition, in bounded loops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import httpx
import pytest

from idem_middleware import LeaseExpiry, PostgresStore, RecordKey
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    LeaseProbe,
    Step,
    assert_problem,
    build_lease_app,
    client,
    count,
    reset_downstream,
)

BODY = {"account": "acc-1", "amount": 100}
HEADERS = {"idempotency-key": "k1"}


class RenewalLog(PostgresStore):
    """Notes each renewal's answer as it returns."""

    answers: list[bool]

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        alive = await super().heartbeat(key, generation, lease_seconds)
        self.answers.append(alive)
        return alive


@pytest.fixture
async def bank(pool: asyncpg.Pool[Any]) -> asyncpg.Pool[Any]:
    await reset_downstream(pool)
    return pool


@pytest.fixture
async def renewals(db_target: tuple[str, dict[str, Any]]) -> AsyncIterator[RenewalLog]:
    dsn, _ = db_target
    async with RenewalLog(dsn=dsn, min_size=1, max_size=4, listen=False) as store:
        store.answers = []
        yield store


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(int(BOUND / 0.01)):
        if await condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def lock_waiters(pool: asyncpg.Pool[Any]) -> int:
    n: int = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    return n


async def lease_live(pool: asyncpg.Pool[Any]) -> bool:
    live: bool = await pool.fetchval(
        "SELECT lease_expires_at > now() FROM idem_requests WHERE idem_key = 'k1'"
    )
    return live


async def state(pool: asyncpg.Pool[Any]) -> str:
    s: str = await pool.fetchval("SELECT state FROM idem_requests WHERE idem_key = 'k1'")
    return s


def post(c: httpx.AsyncClient) -> Awaitable[httpx.Response]:
    return c.post(PAYOUTS, json=BODY, headers=HEADERS)


async def test_renewals_never_wait_on_the_executors_own_fenced_transaction(
    renewals: RenewalLog, bank: asyncpg.Pool[Any], pg_store: PostgresStore
) -> None:
    """The handler opens its fence, then waits on a slow downstream call past its lease. Each
    renewal blocked on the record's row lock that very fence held: a second pooled connection
    held all along (`wait_event_type = 'Lock'`), for nothing, as the lease could not be renewed.
    Now a renewal answers at once (alive: nobody can take the record over while the fence holds
    its row); a duplicate that finds the lease lapsed waits on the fence no longer than its
    wait and runs nothing; the settlement commits with the fenced write."""
    policy = LEASE_POLICY.replace(
        lease_seconds=0.3, wait_seconds=0.2, on_lease_expiry=LeaseExpiry.TAKEOVER
    )
    app = build_lease_app(renewals, bank, policy)
    other = build_lease_app(pg_store, bank, policy)
    probe: LeaseProbe = app.state.probe
    gate = asyncio.Event()
    probe.steps = [Step(gate=gate, fence="before")]
    async with client(app) as c, client(other) as c2:
        first = asyncio.ensure_future(post(c))
        try:
            await asyncio.wait_for(probe.entered.wait(), BOUND)

            async def renewed_twice_or_blocked() -> bool:
                return len(renewals.answers) >= 2 or await lock_waiters(bank) > 0

            await until(renewed_twice_or_blocked, "two renewals, or one blocked on the lock")
            assert await lock_waiters(bank) == 0
            assert renewals.answers[:2] == [True, True]
            await until(lambda: _not(lease_live(bank)), "the lease to lapse under the fence")
            assert not probe.contexts[0].lease_lost.is_set()
            duplicate = await asyncio.wait_for(post(c2), BOUND)
            assert_problem(duplicate, 409, "request-in-flight")
            assert probe.calls == 1
            assert other.state.probe.calls == 0
        finally:
            gate.set()
        response = await asyncio.wait_for(first, BOUND)
    assert response.status_code == 201, response.text
    assert await state(bank) == "succeeded"
    assert await count(bank, "test_ledger") == 1


async def test_a_fence_whose_connection_died_is_renewed_again_and_not_taken_over(
    renewals: RenewalLog, bank: asyncpg.Pool[Any], pg_store: PostgresStore
) -> None:
    """The fence's connection dies (pg_terminate_backend) while its handler still waits on the
    downstream call, its lease lapsed under the fence: the lock is gone with it, and the next
    renewal renews the lease, so a duplicate does not take the record over while the handler
    runs. The handler's settlement cannot commit (its fenced transaction, with its write, is
    gone): the record is `unknown` (the downstream call was made), not re-run."""
    policy = LEASE_POLICY.replace(
        lease_seconds=0.6, wait_seconds=0.2, on_lease_expiry=LeaseExpiry.TAKEOVER
    )
    app = build_lease_app(renewals, bank, policy)
    other = build_lease_app(pg_store, bank, policy)
    probe: LeaseProbe = app.state.probe
    gate = asyncio.Event()
    probe.steps = [Step(gate=gate, fence="before")]
    async with client(app) as c, client(other) as c2:
        first = asyncio.ensure_future(post(c))
        try:
            await asyncio.wait_for(probe.entered.wait(), BOUND)
            await until(lambda: _not(lease_live(bank)), "the lease to lapse under the fence")
            fenced = await probe.contexts[0].fenced_connection()
            assert await bank.fetchval("SELECT pg_terminate_backend($1)", fenced.get_server_pid())
            await until(lambda: lease_live(bank), "a renewal once the fence is gone")
            duplicate = await asyncio.wait_for(post(c2), BOUND)
            assert_problem(duplicate, 409, "request-in-flight")
            assert other.state.probe.calls == 0
            assert not probe.contexts[0].lease_lost.is_set()
        finally:
            gate.set()
        response = await asyncio.wait_for(first, BOUND)
    assert_problem(response, 503, "store-unavailable")
    assert await state(bank) == "unknown"
    assert await count(bank, "test_ledger") == 0


async def _not(condition: Awaitable[bool]) -> bool:
    return not await condition
