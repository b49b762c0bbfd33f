"""Retention counts from the outcome, not from the claim: an outcome is replayed for its whole
`retention_seconds` after it was written, however long its transaction (a transactional claim's,
or lease mode's fenced one) had been open before."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, get_context
from idem_middleware.sql import queries
from idem_middleware.tokens import TokenIssuer
from tests.apps import client, one_route_app
from tests.apps.concurrency import BOUND, lock_waiters, wait_for_waiters

RETENTION = 60
_Q = queries()


async def _expiry_after_handler(store: PostgresStore, pool: Any, policy: Policy, key: str) -> Any:
    """`expires_at - (the handler's last moment)` of the record one request leaves."""
    ends: list[Any] = []

    async def handler(request: Request) -> Response:
        conn = await get_context(request).fenced_connection()
        await conn.execute("SELECT 1")  # the transaction has begun (lease mode: the fence)
        await asyncio.sleep(0.2)  # the handler's work, inside its transaction
        ends.append(await conn.fetchval("SELECT clock_timestamp()"))
        return JSONResponse({"ok": True}, status_code=201)

    app = one_route_app("/things", handler, store=store, default_policy=policy)
    async with client(app) as c:
        response = await c.post("/things", json={}, headers={"idempotency-key": key})
    assert response.status_code == 201
    query = "SELECT expires_at FROM idem_requests WHERE idem_key = $1"
    expires_at = await pool.fetchval(query, key)
    return (expires_at - ends[0]).total_seconds()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"], indirect=True)
@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_an_outcome_is_kept_its_whole_retention_after_it_was_written(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    policy = Policy(mode=mode, retention_seconds=RETENTION)
    assert await _expiry_after_handler(pg_store, pool, policy, "k") >= RETENTION


async def test_a_token_claims_outcome_is_kept_its_whole_retention(
    pg_store: PostgresStore, pool: Any
) -> None:
    # A token claim writes its pending record at once and completes it with an UPDATE.
    token = await TokenIssuer(pg_store, secret=b"s" * 32).issue("tenant-a", "POST /things")
    policy = Policy(require_token=True, retention_seconds=RETENTION)
    assert await _expiry_after_handler(pg_store, pool, policy, token.token) >= RETENTION


@pytest.mark.parametrize(
    "limits",
    [
        {"batch_size": 0},
        {"batch_size": -1},  # the twin sliced its records with it
        {"max_batches": -5},
        {"batch_size": 1.5},  # sent to the server as a LIMIT
        {"batch_size": True},
        {"batch_size": "10"},
        {"max_batches": None},
        {"batch_size": 2**63},  # asyncpg's DataError escaped
    ],
    ids=repr,
)
async def test_purge_refuses_limits_that_are_not_whole_numbers_of_rows(
    store: Any, limits: dict[str, Any]
) -> None:
    """Found by probing: the twin took 0 or a negative count as it came (a slice of its
    records), the real store sent a fraction to the server, and each refused other values with a
    different error, if at all. Both now refuse the same values, before touching a row."""
    with pytest.raises(ValueError, match="whole number from 1 to 2147483647"):
        await store.purge(**limits)


def _counting_app(
    store: PostgresStore, mode: Mode, gate: asyncio.Event | None = None
) -> tuple[Any, list[int]]:
    """`POST /things`: answers 201 with how many times it has run, after `gate` if given."""
    runs: list[int] = []

    async def handler(request: Request) -> Response:
        runs.append(1)
        if gate is not None:
            await asyncio.wait_for(gate.wait(), BOUND)
        return JSONResponse({"run": len(runs)}, status_code=201)

    policy = Policy(mode=mode, retention_seconds=RETENTION, wait_seconds=BOUND)
    return one_route_app("/things", handler, store=store, default_policy=policy), runs


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"], indirect=True)
@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_retry_of_a_key_being_purged_waits_for_the_purge_and_runs_once_afresh(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    """Purge holds the expired record's row (its batch deleted it, not yet committed) when the
    retry of that key arrives: the retry's claim finds the row held and waits for the batch (in
    the process, without a connection: it used to wait inside PostgreSQL, holding one), then
    claims the key as new and runs once. Never a replay of the purged outcome, never two runs,
    never a 500."""
    app, _ = _counting_app(pg_store, mode)
    headers = {"idempotency-key": "k-purged"}
    async with client(app) as c:
        assert (await c.post("/things", json={}, headers=headers)).json() == {"run": 1}
        await pool.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        async with pool.acquire() as sweeper, sweeper.transaction():
            assert await sweeper.execute(_Q["purge_batch"], 100, None) == "DELETE 1"
            retry = asyncio.create_task(c.post("/things", json={}, headers=headers))
            await wait_for_waiters(app)  # the retry's claim found the deleted row held
            assert await lock_waiters(pool) == 0
        response = await asyncio.wait_for(retry, BOUND)
        replay = await c.post("/things", json={}, headers=headers)
    assert (response.status_code, response.json()) == (201, {"run": 2}), response.text
    assert (replay.status_code, replay.json()) == (201, {"run": 2})
    rows = await pool.fetch("SELECT state, expires_at > now() AS live FROM idem_requests")
    assert [tuple(r) for r in rows] == [("succeeded", True)]


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_purge_passes_over_an_expired_record_a_retry_has_reclaimed(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    """The retry reclaimed the expired record and its handler is running when purge comes:
    purge deletes nothing (the record is the retry's now: locked by its transaction, or pending
    in lease mode), and the retry's outcome is stored."""
    gate = asyncio.Event()
    app, runs = _counting_app(pg_store, mode, gate)
    headers = {"idempotency-key": "k-reclaimed"}
    async with client(app) as c:
        gate.set()
        assert (await c.post("/things", json={}, headers=headers)).json() == {"run": 1}
        gate.clear()
        await pool.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        retry = asyncio.create_task(c.post("/things", json={}, headers=headers))
        for _ in range(int(BOUND / 0.01)):  # until the retry's handler runs
            if len(runs) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(runs) == 2
        assert await pg_store.purge() == 0
        gate.set()
        response = await asyncio.wait_for(retry, BOUND)
    assert (response.status_code, response.json()) == (201, {"run": 2}), response.text
    rows = await pool.fetch("SELECT state, expires_at > now() AS live FROM idem_requests")
    assert [tuple(r) for r in rows] == [("succeeded", True)]
