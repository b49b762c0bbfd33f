"""The store's pool under settings operators pick: one connection (`max_size=1`, `min_size`
0 or 1), connections recycled between a claim and its settlement (asyncpg's
`max_inactive_connection_lifetime` tiny, `max_queries=1`), no statement cache. A storm of
duplicates of one key and fresh keys at once, in both modes: every request is answered (the
outcome, its replay, or a refusal with `Retry-After`, never a 500 or a hang), each effect once.
And lease mode's renewals while another request's fenced transaction holds every connection:
they run outside the pool (store/postgres/renewals.py), so the lease holds. Real PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx
import pytest

from idem_middleware import LeaseExpiry, Mode, Policy, PostgresStore
from tests.apps import (
    BOUND,
    PAYOUTS,
    Step,
    build_app,
    build_lease_app,
    client,
    key,
    reset_downstream,
)

OPTIONS = {
    "plain": {},
    "recycled-idle": {"max_inactive_connection_lifetime": 0.01},
    "one-query": {"max_queries": 1},
    "no-cache": {"statement_cache_size": 0},
}


def _store(dsn: str, min_size: int, options: dict[str, Any], **more: Any) -> PostgresStore:
    options = dict(options)
    cache = options.pop("statement_cache_size", 100)
    return PostgresStore(
        dsn=dsn,
        min_size=min_size,
        max_size=1,
        statement_cache_size=cache,
        connect_kwargs=options,
        **more,
    )


def _answered(replies: list[httpx.Response]) -> None:
    """Every reply the outcome, its replay, or a refusal a retry with the key may follow."""
    for reply in replies:
        assert reply.status_code in (201, 409, 503), reply.text
        if reply.status_code != 201:
            assert reply.headers["content-type"] == "application/problem+json"
            assert "retry-after" in reply.headers


@pytest.mark.parametrize("min_size", [0, 1])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
async def test_a_storm_on_a_pool_of_one_transactional(
    db_dsn: str, pool: asyncpg.Pool[Any], min_size: int, options: dict[str, Any]
) -> None:
    async with _store(db_dsn, min_size, options, listen=False) as store:
        app = build_app(store, default_policy=Policy(wait_seconds=2), acquire_timeout=1)
        async with client(app) as c:
            sent = [
                c.post("/accounts/dup/credits", json={"amount": 5}, headers=key("dup"))
                for _ in range(20)
            ] + [
                c.post(f"/accounts/f{i}/credits", json={"amount": 5}, headers=key(f"f{i}"))
                for i in range(5)
            ]
            replies = await asyncio.wait_for(asyncio.gather(*sent), 6 * BOUND)
    _answered(replies)
    ran = await pool.fetch("SELECT account_id, count(*) AS n FROM test_ledger GROUP BY 1")
    assert all(row["n"] == 1 for row in ran), ran
    assert len(ran) == app.state.probe.calls  # each handler run committed, once per key


@pytest.mark.parametrize("min_size", [0, 1])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
async def test_a_storm_on_a_pool_of_one_lease(
    db_dsn: str, pool: asyncpg.Pool[Any], min_size: int, options: dict[str, Any]
) -> None:
    """The first execution holds its fence (the only connection) past its lease: its record
    is never taken from it (the row lock), the fresh keys' fences wait out `acquire_timeout`
    (503, their records then `unknown`), and the duplicates get the replay or a 503."""
    await reset_downstream(pool)
    async with _store(db_dsn, min_size, options) as store:
        policy = Policy(mode=Mode.LEASE, lease_seconds=1.0, wait_seconds=2)
        app = build_lease_app(store, pool, policy, acquire_timeout=1)
        gate = asyncio.Event()
        app.state.probe.steps = [Step(fence="before", gate=gate)]
        async with client(app) as c:
            first = asyncio.ensure_future(
                c.post(PAYOUTS, json={"account": "dup", "amount": 5}, headers=key("dup"))
            )
            await asyncio.wait_for(app.state.probe.entered.wait(), BOUND)
            sent = [
                c.post(PAYOUTS, json={"account": "dup", "amount": 5}, headers=key("dup"))
                for _ in range(20)
            ] + [
                c.post(PAYOUTS, json={"account": f"f{i}", "amount": 5}, headers=key(f"f{i}"))
                for i in range(5)
            ]
            later = asyncio.ensure_future(asyncio.gather(*sent))
            await asyncio.sleep(0.5)  # (not timed: the order of the requests changes nothing)
            gate.set()
            replies = [await asyncio.wait_for(first, BOUND)]
            replies += await asyncio.wait_for(later, 6 * BOUND)
    _answered(replies)
    assert replies[0].status_code == 201
    ran = await pool.fetch("SELECT account_id, count(*) AS n FROM test_ledger GROUP BY 1")
    assert all(row["n"] == 1 for row in ran), ran
    assert await pool.fetchval("SELECT count(*) FROM test_downstream") <= 1 + 5


async def _lease_ends(pool: asyncpg.Pool[Any], idem_key: str) -> Any:
    return await pool.fetchval(
        "SELECT lease_expires_at FROM idem_requests WHERE idem_key = $1", idem_key
    )


async def _until_renewed(pool: asyncpg.Pool[Any], idem_key: str, since: Any) -> None:
    for _ in range(int(BOUND / 0.02)):
        if await _lease_ends(pool, idem_key) > since:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the lease was never renewed")


async def test_a_fence_holding_the_only_connection_leaves_another_executions_renewals_alone(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    """On a pool of one, request Y's fenced transaction holds the only connection while request
    X's handler runs. X's renewals took a pool connection like any statement: they waited for
    it, X's lease lapsed while its handler ran, another process's duplicate took the record
    over (`TAKEOVER`) and ran the handler again, and X was answered 409. They run on the
    store's renewal connection now, outside the pool: X's lease is renewed while Y holds the
    pool, the duplicate is refused (in flight), and the handler runs once."""
    await reset_downstream(pool)
    policy = Policy(
        mode=Mode.LEASE, lease_seconds=1.5, wait_seconds=0.3, on_lease_expiry=LeaseExpiry.TAKEOVER
    )
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1) as store:
        app = build_lease_app(store, pool, policy, acquire_timeout=0.3)
        x_gate, y_gate = asyncio.Event(), asyncio.Event()
        probe = app.state.probe
        probe.steps = [Step(fence="after", gate=x_gate), Step(fence="before", gate=y_gate)]
        async with client(app) as c:
            x = asyncio.ensure_future(
                c.post(PAYOUTS, json={"account": "x", "amount": 5}, headers=key("x"))
            )
            await asyncio.wait_for(probe.entered.wait(), BOUND)
            probe.entered.clear()
            y = asyncio.ensure_future(
                c.post(PAYOUTS, json={"account": "y", "amount": 5}, headers=key("y"))
            )
            await asyncio.wait_for(probe.entered.wait(), BOUND)
            # Y's fence holds the pool's only connection from here until y_gate.
            assert (store.pool.get_size(), store.pool.get_idle_size()) == (1, 0)
            await _until_renewed(pool, "x", await _lease_ends(pool, "x"))
            async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2) as elsewhere:
                other = build_lease_app(elsewhere, pool, policy)
                async with client(other) as d:
                    again = await d.post(
                        PAYOUTS, json={"account": "x", "amount": 5}, headers=key("x")
                    )
            y_gate.set()
            x_gate.set()
            x_reply = await asyncio.wait_for(x, BOUND)
            y_reply = await asyncio.wait_for(y, BOUND)
    assert again.status_code == 409, again.text  # in flight, not taken over
    assert other.state.probe.calls == 0  # the handler did not run again
    assert x_reply.status_code == 201, x_reply.text
    assert y_reply.status_code == 201
    assert not probe.contexts[0].lease_lost.is_set()


async def test_a_checkout_timing_out_at_open_is_named_in_the_warning(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An acquire_timeout no checkout can meet: the schema check is skipped with a warning that
    says why (it read "cannot check the idempotency schema now: ", a TimeoutError has no text)."""
    with caplog.at_level("WARNING", logger="idem_middleware"):
        async with PostgresStore(dsn=db_dsn, acquire_timeout=1e-9, listen=False):
            pass
    warned = [r.getMessage() for r in caplog.records if "schema now" in r.getMessage()]
    assert warned == [
        "cannot check the idempotency schema now: TimeoutError (no connection within 1e-09 s)"
    ]
