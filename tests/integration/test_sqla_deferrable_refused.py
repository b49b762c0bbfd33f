"""A claim session asked for `postgresql_deferrable=True`: its transaction is a savepoint in the
claim's, which takes no characteristics, so DEFERRABLE would be dropped without a word. Refused
at the session's checkout (ConfigurationError), before any statement, as AUTOCOMMIT and READ
ONLY are (test_sqla_characteristics.py); nothing is written and the key is free."""

from __future__ import annotations

from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from idem_middleware.errors import ConfigurationError
from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_sqla_characteristics import INSERT, store  # noqa: F401


async def test_a_deferrable_session_is_refused(
    store: PostgresStore,  # noqa: F811
    pool: asyncpg.Pool[Any],
) -> None:
    app = FastAPI()

    @app.post("/accounts")
    async def create(session: ClaimSession) -> dict[str, str]:
        await session.connection(execution_options={"postgresql_deferrable": True})
        await session.execute(INSERT, {"id": "kept"})
        return {"ok": "yes"}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        with pytest.raises(ConfigurationError, match="postgresql_deferrable"):
            await http.post("/accounts", headers={"Idempotency-Key": "k"})
    assert await pool.fetch("SELECT account_id FROM test_accounts") == []
    assert await pool.fetch("SELECT state FROM idem_requests") == []
