"""A database or role whose `default_transaction_isolation` is REPEATABLE READ: the store's
statements that commit on their own, and lease mode's fence, meet a concurrent write with a
serialization failure where READ COMMITTED would have waited and read the new row. Each is run
again (it changed nothing), so a claim, a settlement and a fence answer as they would under
READ COMMITTED instead of failing the request. Under SERIALIZABLE, a fenced transaction the server
refuses at its settlement cannot run again: it is reported as the store's failure (a 503).

Each test holds a conflicting write open on a connection of its own, lets the store's statement
queue behind it, then commits it: the statement's snapshot is then older than the row it meets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Existing, RecordKey, Settlement, State, StoredResponse
from tests.apps import BOUND, wait_for_lock_waiters

KEY = RecordKey("t", "POST /payouts", "k")
INSERT = (
    "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, retention,"
    " generation, lease_expires_at) VALUES ($1, $2, $3, '\\x00', $4, 'lease', interval '1 day',"
    " 7, now() + interval '1 minute')"
)


@pytest.fixture
async def rr_store(db_dsn: str, pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    """A store whose sessions default to REPEATABLE READ (as `ALTER ROLE ... SET` would make)."""
    settings = {"default_transaction_isolation": "repeatable read"}
    async with PostgresStore(
        dsn=db_dsn, listen=False, connect_kwargs={"server_settings": settings}
    ) as store:
        async with store.pool.acquire() as conn:
            assert await conn.fetchval("SHOW transaction_isolation") == "repeatable read"
        yield store


async def _behind(pool: asyncpg.Pool[Any], statement: str, *args: Any, work: Any) -> Any:
    """Run `work` while `statement` is held uncommitted, let it queue on the row, then commit."""
    async with pool.acquire() as blocker:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute(statement, *args)
        task = asyncio.ensure_future(work)
        try:
            await wait_for_lock_waiters(pool)
        finally:
            await tx.commit()
        return await asyncio.wait_for(task, BOUND)


async def test_a_lease_claim_that_meets_a_concurrent_claim_reads_its_record(
    rr_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    claim = rr_store.claim_lease(
        KEY, b"\x01", retention_seconds=60, lease_seconds=30, token_hash=None
    )
    got = await _behind(pool, INSERT, *KEY, "pending", work=claim)
    assert isinstance(got, Existing)  # was: RetryableConflict, a 500 to the client
    assert (got.record.state, got.record.generation) == (State.PENDING, 7)


async def test_a_settlement_that_meets_a_heartbeat_settles(
    rr_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    await pool.execute(INSERT, *KEY, "pending")
    settle = rr_store.settle(
        KEY,
        7,
        State.PENDING,
        Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}")),
    )
    heartbeat = (
        "UPDATE idem_requests SET lease_expires_at = now() + interval '2 minutes'"
        " WHERE idem_key = $1"
    )
    assert await _behind(pool, heartbeat, KEY.key, work=settle) is True
    assert await pool.fetchval("SELECT state FROM idem_requests") == "succeeded"


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"])
async def test_a_fence_that_meets_a_heartbeat_holds_the_record(
    db_dsn: str, pool: asyncpg.Pool[Any], fast_path: bool
) -> None:
    await pool.execute(INSERT, *KEY, "pending")
    settings = {"default_transaction_isolation": "repeatable read"}
    async with PostgresStore(
        dsn=db_dsn,
        listen=False,
        fast_path=fast_path,
        connect_kwargs={"server_settings": settings},
    ) as store:

        async def fenced_write() -> bool:
            async with store.fenced(KEY, 7) as session:
                await session.connection.execute(
                    "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'a', 1)"
                )
                return await session.settle(
                    Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
                )

        heartbeat = (
            "UPDATE idem_requests SET lease_expires_at = now() + interval '2 minutes'"
            " WHERE idem_key = $1"
        )
        assert await _behind(pool, heartbeat, KEY.key, work=fenced_write()) is True
    assert await pool.fetchval("SELECT state FROM idem_requests") == "succeeded"
    assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 1


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"])
async def test_a_fenced_settlement_refused_under_serializable_is_a_store_error(
    db_dsn: str, pool: asyncpg.Pool[Any], fast_path: bool
) -> None:
    """Two fenced transactions at once under SERIALIZABLE meet on `idem_requests`' pages and
    the server refuses the second at its settlement. It cannot run again (its handler ran): it
    is a StoreError, a 503 whose outcome is unknown, as for a lost connection (it was a
    RetryableConflict, which nothing on the lease path handles: a plain 500)."""
    other = RecordKey(KEY.tenant, KEY.operation, "k2")
    for key in (KEY, other):
        await pool.execute(INSERT, *key, "pending")
    settings = {"default_transaction_isolation": "serializable"}
    done = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
    async with (
        PostgresStore(
            dsn=db_dsn,
            listen=False,
            fast_path=fast_path,
            connect_kwargs={"server_settings": settings},
        ) as store,
        store.fenced(KEY, 7) as first,
        store.fenced(other, 7) as second,
    ):
        assert await first.settle(done) is True
        with pytest.raises(StoreError) as refused:
            await second.settle(done)
    assert isinstance(refused.value.__cause__, asyncpg.SerializationError)
    states = await pool.fetch("SELECT idem_key, state FROM idem_requests ORDER BY idem_key")
    assert [tuple(r) for r in states] == [("k", "succeeded"), ("k2", "pending")]


async def test_an_outbox_send_recorded_behind_a_concurrent_write_is_marked_sent(
    rr_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """A publisher's statements commit on their own, like the store's: one that meets a
    concurrent write of its event (another publisher's reservation once this one's lapsed, an
    operator's requeue) runs again. The mark of a delivered event was refused instead: logged,
    the event left reserved and sent again once that lapsed; a refused reservation failed the
    whole batch into the publisher's backoff (2 s, then 4 s...)."""
    from idem_middleware import outbox

    async with pool.acquire() as conn:
        event_id = await outbox.add(conn, "payouts", {"n": 1})
    async with rr_store.outbox_connection() as publisher:
        reserved = await publisher.reserve(10.0, 8)
        assert reserved is not None
        assert reserved.event_id == event_id
        touch = "UPDATE idem_outbox SET last_error = 'touched' WHERE event_id = $1"
        await _behind(pool, touch, event_id, work=publisher.mark_sent(event_id))
    assert await pool.fetchval("SELECT sent_at IS NOT NULL FROM idem_outbox") is True


async def test_transactional_claims_of_different_keys_under_serializable_run_again(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    """Found by probing (docs/operating.md): under SERIALIZABLE, two transactional requests with
    different keys, at once, each read `idem_requests`' primary key where its key would be and
    then insert there; on a small table (or with sequential keys) that is the same index page,
    and the server refuses one of them. It runs again, handler included (its writes were rolled
    back): both are answered 201 and each key is recorded once, at the price of a re-run. (In
    a storm, past `max_serialization_retries`, some are answered 409 and run on the retry.)"""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from idem_middleware import get_context
    from tests.apps import client, one_route_app

    settings = {"default_transaction_isolation": "serializable"}
    runs: list[str] = []
    both = asyncio.Barrier(2)

    async def charge(request: Request) -> Response:
        ctx = get_context(request)
        runs.append(ctx.key)
        if len(runs) <= 2:
            await asyncio.wait_for(both.wait(), BOUND)  # both claimed before either settles
        return JSONResponse({"key": ctx.key}, status_code=201)

    async with PostgresStore(
        dsn=db_dsn, listen=False, connect_kwargs={"server_settings": settings}
    ) as store:
        app = one_route_app("/charges", charge, store=store)
        async with client(app) as c:
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(c.post("/charges", json={}, headers={"Idempotency-Key": k}) for k in "ab")
                ),
                2 * BOUND,
            )
    assert [r.status_code for r in answers] == [201, 201]
    assert sorted(runs[:2]) == ["a", "b"]
    assert len(runs) == 3  # one of them ran again
    keys = await pool.fetch("SELECT idem_key FROM idem_requests ORDER BY idem_key")
    assert [r["idem_key"] for r in keys] == ["a", "b"]
