"""A pooled connection the server ended while it sat idle (`idle_session_timeout`, a restart):
the claim's first statement finds out, and the claim is made again on another connection. It
was answered `503 store-unavailable` (found by probing: 11 requests in 200 with the timeout at
300 ms and pauses about as long), while nothing of the transaction had been done."""

from __future__ import annotations

import asyncio
import threading

import asyncpg
import pytest

from idem_middleware.store import Claimed, RecordKey, State, StoredResponse
from idem_middleware.store.base import TokenRefused
from idem_middleware.store.postgres import PostgresStore


def _ended_behind_the_pools_back(dsn: str, pid: int) -> None:
    """The server ends the session `pid` while this thread's caller's loop is blocked: its
    connection cannot have read the server's goodbye before the claim's first statement."""

    async def terminate() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "SELECT pg_terminate_backend($1, 5000)", pid
            )  # (returns once it has ended)
        finally:
            await conn.close()

    thread = threading.Thread(target=asyncio.run, args=(terminate(),))
    thread.start()
    thread.join(10)


@pytest.mark.parametrize("path", ["fast", "ordinary"])
async def test_a_claim_on_a_connection_the_server_ended_is_made_on_another(
    db_dsn: str, path: str
) -> None:
    key = RecordKey("t", "POST /pay", f"idle-{path}")
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
        pid = await store.pool.fetchval("SELECT pg_backend_pid()")
        _ended_behind_the_pools_back(db_dsn, pid)
        async with store.transaction(acquire_timeout=5) as tx:
            # (A token claim takes the ordinary path: BEGIN, then the claim's statements.)
            token = b"\x00" * 32 if path == "ordinary" else None
            claim = await tx.claim(
                key, b"f", retention_seconds=60, wait_seconds=1, token_hash=token
            )
            if path == "ordinary":
                assert isinstance(claim, TokenRefused)  # (no such token: still an answer)
            else:
                assert isinstance(claim, Claimed)
                await tx.finish(State.SUCCEEDED, StoredResponse(201, [], b"ok"))
        assert await store.pool.fetchval("SELECT pg_backend_pid()") != pid
        record = await store.get(key)
    if path == "fast":
        assert record is not None
        assert record.state is State.SUCCEEDED
