"""A claim session whose own end fails on a write it still held (a duplicate added and never
flushed by the handler): the IntegrityError is the handler's, and it goes on to the server with
its traceback, nothing written and the key free. It is not taken for a statement the handler
caught and answered after (that is `500 server-misconfigured`, logged as such): only an aborted
transaction is."""

from __future__ import annotations

from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore
from tests.apps import count
from tests.integration.test_sqla_handler_errors import Account, store  # noqa: F401

_ROW = text("INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'before', 1)")


async def test_a_duplicate_flushed_at_the_sessions_end_raises_its_own_error(
    store: PostgresStore,  # noqa: F811
    pool: asyncpg.Pool[Any],
) -> None:
    app = FastAPI()
    calls = []

    @app.post("/accounts", status_code=201)
    async def create(session: ClaimSession) -> dict[str, bool]:
        calls.append(1)
        await session.execute(_ROW)
        session.add(Account(tenant="t", account_id="taken"))  # flushed at the session's end
        return {"ok": True}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        with pytest.raises(IntegrityError):
            await http.post("/accounts", json={}, headers={"Idempotency-Key": "k"})
    assert calls == [1]
    assert await count(pool, "idem_requests") == 0
    assert await count(pool, "test_ledger") == 0
