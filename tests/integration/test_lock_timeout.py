"""A `lock_timeout` set on the store's role or database (here: on its sessions, which is the
same to the server) cancels the store's statements that wait for a row lock another session
holds: lease mode's fence and settlement, and a lease claim behind another's uncommitted
insert. Each did nothing, as under `statement_timeout`: the request is answered `503
store-unavailable` (each escaped as a plain 500, and the fence left its transaction open for
the pool's reset). The statements that lock NOWAIT raise the same error at once, meaning
"busy": those stay `409 request-in-flight`. Real PostgreSQL; the other session is a test's
transaction holding the record's row (an operator's, a DBA's, another process's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import LeaseExpiry, Mode, Policy, PostgresStore, RecordKey
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed
from idem_middleware.store.postgres.claim import expire_lapsed
from tests.apps import (
    BOUND,
    PAYOUTS,
    Step,
    assert_problem,
    build_lease_app,
    client,
    key,
    reset_downstream,
)

#: The role's lock_timeout: far below any wait of the test, so it is always the one that ends it.
LOCK_TIMEOUT = {"server_settings": {"lock_timeout": "50ms"}}
#: Short, so that a settlement sent again (for a third of the lease) gives up soon.
POLICY = Policy(mode=Mode.LEASE, lease_seconds=0.6, wait_seconds=0.3)
BODY = {"account": "acc-1", "amount": 5}


@pytest.fixture(params=[True, False], ids=["fast", "ordinary"])
async def store(request: pytest.FixtureRequest, db_dsn: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(
        dsn=db_dsn, max_size=4, connect_kwargs=LOCK_TIMEOUT, fast_path=request.param
    ) as opened:
        yield opened


async def _row_held(conn: Any, idem_key: str) -> None:
    await conn.execute("SELECT 1 FROM idem_requests WHERE idem_key = $1 FOR UPDATE", idem_key)


@pytest.mark.parametrize("fence", ["after", None], ids=["fence", "settlement"])
async def test_a_lease_execution_waiting_past_lock_timeout_is_answered_503(
    store: PostgresStore,
    pool: asyncpg.Pool[Any],
    fence: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handler's fence (`fenced_connection()`), or its settlement without one, waits for
    the record's row another session holds: cancelled by lock_timeout, a 503 (was a 500)."""
    await reset_downstream(pool)
    app = build_lease_app(store, pool, POLICY)
    gate = asyncio.Event()
    app.state.probe.steps = [Step(fence=fence, gate=gate)]
    async with client(app) as c:
        sent = asyncio.ensure_future(c.post(PAYOUTS, json=BODY, headers=key("held")))
        await asyncio.wait_for(app.state.probe.entered.wait(), BOUND)
        async with pool.acquire() as other, other.transaction():
            await _row_held(other, "held")
            gate.set()
            reply = await asyncio.wait_for(sent, BOUND)
    assert_problem(reply, 503, "store-unavailable")
    assert reply.headers["retry-after"] == "1"
    # Nothing of the fence committed, and no transaction was left open for the pool's reset.
    assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 0
    assert "active transaction" not in caplog.text


async def test_a_lease_claim_waiting_past_lock_timeout_is_answered_503(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """Another session's uncommitted insert of the key (which its snapshot cannot see) makes
    the lease claim's INSERT wait: cancelled by lock_timeout, a 503 (was a 500); the handler
    never ran."""
    await reset_downstream(pool)
    app = build_lease_app(store, pool, POLICY)
    async with client(app) as c, pool.acquire() as other, other.transaction():
        await other.execute(
            "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
            "retention, lease_expires_at, epoch) VALUES ('tenant-a', $1, 'racing', '\\x00', "
            "'pending', 'lease', '1 day', now() + interval '1 hour', 1)",
            f"POST {PAYOUTS}",
        )
        reply = await asyncio.wait_for(c.post(PAYOUTS, json=BODY, headers=key("racing")), BOUND)
    assert_problem(reply, 503, "store-unavailable")
    assert app.state.probe.calls == 0


async def test_a_takeover_of_a_held_record_stays_busy_under_lock_timeout(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """The takeover locks NOWAIT: the same error, raised at once, means another session holds
    the record (its executor's fence past its lease): the duplicate waits and is answered 409
    request-in-flight, never the 503 of a lock wait cancelled."""
    await reset_downstream(pool)
    policy = Policy(
        mode=Mode.LEASE, lease_seconds=30, wait_seconds=0.3, on_lease_expiry=LeaseExpiry.TAKEOVER
    )
    app = build_lease_app(store, pool, policy)
    async with client(app) as c:
        first = await c.post(PAYOUTS, json=BODY, headers=key("lapsed"))
        assert first.status_code == 201, first.text
        # The record as a lapsed execution leaves it: pending, its lease over.
        await pool.execute(
            "UPDATE idem_requests SET state = 'pending', lease_expires_at = now() - interval "
            "'1 s', expires_at = NULL, response_status = NULL, response_headers = NULL, "
            "response_body = NULL"
        )
        async with pool.acquire() as other, other.transaction():
            await _row_held(other, "lapsed")
            reply = await asyncio.wait_for(c.post(PAYOUTS, json=BODY, headers=key("lapsed")), BOUND)
    assert_problem(reply, 409, "request-in-flight")
    assert app.state.probe.calls == 1


@pytest.mark.parametrize("read", ["get", "peek"])
@pytest.mark.parametrize("setting", ["lock_timeout", "statement_timeout"])
async def test_a_record_read_behind_a_table_lock_is_a_store_error(
    db_dsn: str, pool: asyncpg.Pool[Any], setting: str, read: str
) -> None:
    """A lease-mode duplicate reads the record while a migration holds the table (`ALTER
    TABLE`: ACCESS EXCLUSIVE), and the role's `lock_timeout` or `statement_timeout` cancels the
    read: a `StoreError` (the duplicate polls on, then answers as documented), not asyncpg's
    own error, which escaped as a plain 500 (from the status resource's `peek` too)."""
    settings = {"server_settings": {setting: "50ms"}}
    opened = PostgresStore(dsn=db_dsn, max_size=2, connect_kwargs=settings)
    async with opened as store, pool.acquire() as other, other.transaction():
        await other.execute("LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(StoreError):
            await asyncio.wait_for(getattr(store, read)(RecordKey("t", "POST /x", "k")), BOUND)


async def test_a_lapsed_lease_marked_behind_a_table_lock_is_a_store_error(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """A transactional claim that finds a lapsed lease-mode record marks it `unknown` in a
    statement of its own: behind a migration's lock, cancelled by the role's `lock_timeout`,
    a `StoreError` (a 503), not asyncpg's own error."""
    key = RecordKey("t", "POST /x", "lapsed")
    claimed = await pg_store.claim_lease(key, b"fp", retention_seconds=60, lease_seconds=0.1)
    assert isinstance(claimed, Claimed)
    await asyncio.sleep(0.2)
    record = await pg_store.get(key)
    assert record is not None
    assert record.lease_expired
    async with pool.acquire() as other, other.transaction():
        await other.execute("LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE")
        async with pool.acquire() as conn:
            await conn.execute("SET lock_timeout = '50ms'")
            try:
                with pytest.raises(StoreError):
                    await asyncio.wait_for(expire_lapsed(conn, record, 1.0), BOUND)
            finally:
                await conn.execute("RESET lock_timeout")
