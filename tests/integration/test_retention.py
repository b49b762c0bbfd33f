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
from idem_middleware.tokens import TokenIssuer
from tests.apps import client, one_route_app

RETENTION = 60


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
