"""FastAPI background tasks run before the application returns, so inside the claim: what
docs/sqlalchemy.md ("Background tasks run inside the claim") promises, on real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import BackgroundTasks, FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.postgres import PostgresStore

INSERT = text("INSERT INTO test_accounts (tenant, account_id) VALUES ('t', :id)")


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pool=pool) as store:
        yield store


async def test_a_background_tasks_writes_and_failure_belong_to_the_claim(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    seen: list[str] = []

    async def after(session: AsyncSession, name: str, fail: bool) -> None:
        await session.execute(INSERT, {"id": f"{name}-task"})
        seen.append(name)
        if fail:
            raise RuntimeError("the background task failed")

    app = FastAPI()

    @app.post("/orders/{name}")
    async def create(
        name: str, session: ClaimSession, tasks: BackgroundTasks, fail: bool = False
    ) -> dict[str, str]:
        await session.execute(INSERT, {"id": name})
        tasks.add_task(after, session, name, fail)
        return {"name": name}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        ok = await http.post("/orders/a", headers={"Idempotency-Key": "a"})
        assert seen == ["a"]  # the task ran before the response was let out
        failed = await http.post("/orders/b?fail=true", headers={"Idempotency-Key": "b"})
    assert ok.status_code == 200, ok.text
    assert failed.status_code == 500
    accounts = await pool.fetch("SELECT account_id FROM test_accounts ORDER BY account_id")
    # The task's write committed with the outcome; the failed task rolled back the handler's.
    assert [r["account_id"] for r in accounts] == ["a", "a-task"]
    states = await pool.fetch("SELECT idem_key, state FROM idem_requests")
    assert {r["idem_key"]: r["state"] for r in states} == {"a": "succeeded"}
