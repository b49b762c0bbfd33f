"""A claim session asked for transaction characteristics it cannot have, on real PostgreSQL.

Its transaction is a savepoint in the claim's, and a savepoint takes none: with
`isolation_level="AUTOCOMMIT"` SQLAlchemy's asyncpg adapter skipped the savepoint, so
`session.rollback()` undid nothing and the rows it should have undone committed with the
outcome; with `postgresql_readonly=True` the session wrote all the same. Both now raise
ConfigurationError at the session's checkout, before any statement.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text

from idem_middleware.errors import ConfigurationError
from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore

INSERT = text("INSERT INTO test_accounts (tenant, account_id) VALUES ('t', :id)")


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pool=pool) as store:
        yield store


@pytest.mark.parametrize(
    "options",
    [{"isolation_level": "AUTOCOMMIT"}, {"postgresql_readonly": True}],
    ids=["autocommit", "readonly"],
)
async def test_a_characteristic_the_savepoint_cannot_have_is_refused(
    store: PostgresStore, pool: asyncpg.Pool[Any], options: dict[str, Any]
) -> None:
    app = FastAPI()

    @app.post("/accounts")
    async def create(session: ClaimSession) -> dict[str, str]:
        await session.connection(execution_options=options)
        await session.execute(INSERT, {"id": "undone"})
        await session.rollback()  # undoes "undone" (or, with AUTOCOMMIT, did nothing)
        await session.execute(INSERT, {"id": "kept"})
        return {"ok": "yes"}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        with pytest.raises(ConfigurationError, match="savepoint"):
            await http.post("/accounts", headers={"Idempotency-Key": "k"})
    assert await pool.fetch("SELECT account_id FROM test_accounts") == []
    assert await pool.fetch("SELECT state FROM idem_requests") == []  # the key is free again


async def test_a_two_phase_session_of_ones_own_is_refused_at_its_begin(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """A session maker of the user's own over the claim engine, two-phase: at `commit()` it
    would send PREPARE TRANSACTION and COMMIT PREPARED on the claim's connection (with prepared
    transactions enabled, the rows committed without the outcome). Refused before any."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from idem_middleware.sqla import claim_engine

    app = FastAPI()
    install(app, store=store, tenant_resolver=lambda scope: "t")
    two_phase = async_sessionmaker(claim_engine(), twophase=True)

    @app.post("/accounts")
    async def create() -> dict[str, str]:
        async with two_phase() as session:
            await session.execute(INSERT, {"id": "a"})
            await session.commit()
        return {"ok": "yes"}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        with pytest.raises(ConfigurationError, match="twophase"):
            await http.post("/accounts", headers={"Idempotency-Key": "k"})
    assert await pool.fetch("SELECT account_id FROM test_accounts") == []
    assert await pool.fetch("SELECT state FROM idem_requests") == []
