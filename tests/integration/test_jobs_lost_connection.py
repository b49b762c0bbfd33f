"""A job whose own connection dies while its function runs (the server ends the session:
`idle_in_transaction_session_timeout`, a restart, `pg_terminate_backend`) raises the store's
StoreError, as a request is answered 503, not the driver's error from the function's next
statement; its record is left as a raising function leaves it."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from idem_middleware import IdempotencyContext, Mode
from idem_middleware.errors import StoreError
from idem_middleware.jobs import JobOutcomeUnknown, idempotent_job
from idem_middleware.store.base import RecordKey, State
from idem_middleware.store.postgres import PostgresStore
from tests.apps import until
from tests.integration.test_http_failures import connection_closed


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_jobs_connection_killed_mid_run_is_a_store_error(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode
) -> None:
    runs: list[str] = []

    @idempotent_job(pg_store, operation="ledger.post", key="k", mode=mode)
    async def job(ctx: IdempotencyContext, *, k: str) -> dict[str, bool]:
        runs.append(k)
        conn = ctx.connection if mode is Mode.TRANSACTIONAL else await ctx.fenced_connection()
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
        # (Once the client has seen it close: before that, asyncpg may raise another error.)
        await until(lambda: connection_closed(conn))
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', $1, 1)", k
        )
        return {"ok": True}

    with pytest.raises(StoreError) as raised:
        await job(k="a")
    assert isinstance(raised.value.__cause__, asyncpg.InterfaceError)
    assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 0
    record = await pg_store.get(RecordKey("", "ledger.post", "a"))
    if mode is Mode.TRANSACTIONAL:
        # Nothing committed: the key is free, and the next delivery runs the job again.
        assert record is None
        with pytest.raises(StoreError):
            await job(k="a")
        assert runs == ["a", "a"]
    else:
        # What the function did elsewhere may have happened: unknown, for an operator.
        assert record is not None
        assert record.state is State.UNKNOWN
        with pytest.raises(JobOutcomeUnknown):
            await job(k="a")
        assert runs == ["a"]
