"""A claim of a key whose record has expired (past its retention, not yet purged) while another
session holds that record's row (an operator's statement, a purge, another claim reclaiming it):
the reclaim, which never waits (`FOR UPDATE NOWAIT`), finds the key busy and the request waits
for it like any busy key, then runs once the row is free (claim.py: `reclaim_expired`'s
lock_not_available is ClaimBusy), instead of `503 store-unavailable` at once."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from idem_middleware import Policy, PostgresStore
from tests.apps import build_app, client, key


async def test_an_expired_record_locked_by_another_session_is_busy_then_reclaimed(
    pool: asyncpg.Pool[Any], pg_store: PostgresStore
) -> None:
    app = build_app(pg_store, default_policy=Policy(wait_seconds=5.0))
    body = {"amount": 5}
    async with client(app) as c:
        first = await c.post("/accounts/a1/credits", json=body, headers=key("expiring"))
        assert first.status_code == 201, first.text
        await pool.execute(
            "UPDATE idem_requests SET expires_at = now() - interval '1 second'"
            " WHERE idem_key = 'expiring'"
        )
        locker = await pool.acquire()
        try:
            tx = locker.transaction()
            await tx.start()
            await locker.execute(
                "SELECT 1 FROM idem_requests WHERE idem_key = 'expiring' FOR UPDATE"
            )
            again = asyncio.create_task(
                c.post("/accounts/a1/credits", json=body, headers=key("expiring"))
            )
            await asyncio.sleep(0.3)  # (the request meets the held row: it must wait, not fail)
            assert not again.done()
            await tx.rollback()
        finally:
            await pool.release(locker)
        second = await asyncio.wait_for(again, 10)
    assert second.status_code == 201, second.text
    assert second.headers.get("idempotent-replayed") is None  # expired: run again, as a new one
    assert app.state.probe.calls == 2
