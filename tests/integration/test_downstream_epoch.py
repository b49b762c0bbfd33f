"""A key reused after its retention is a new request downstream too, in every mode and API:
the downstream key identifies one life of the record (its epoch), not the key alone."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import (
    IdempotencyContext,
    IdempotencyMiddleware,
    MemoryStore,
    Mode,
    Policy,
    PostgresStore,
    get_context,
)
from idem_middleware.jobs import idempotent_job
from tests.apps import BearerBackend, client, key


async def _expire(pool: asyncpg.Pool[Any]) -> None:
    await pool.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_key_reused_after_retention_gets_a_new_downstream_key_over_http(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode
) -> None:
    async def pay(request: Request) -> Response:
        ctx = get_context(request)
        return JSONResponse({"dkey": ctx.downstream_key}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=pg_store, default_policy=Policy(mode=mode)),
        ],
    )
    async with client(app) as c:
        first = await c.post("/pay", json={"amount": 5}, headers=key("K"))
        replay = await c.post("/pay", json={"amount": 5}, headers=key("K"))
        await _expire(pool)
        again = await c.post("/pay", json={"amount": 5}, headers=key("K"))
    assert first.status_code == again.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == first.json(), "a replay is the same life"
    assert "idempotent-replayed" not in again.headers
    assert again.json()["dkey"] != first.json()["dkey"], "a new life sent the old downstream key"


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("kind", ["memory", "postgres"])
async def test_a_job_key_reused_after_retention_gets_a_new_downstream_key(
    pool: asyncpg.Pool[Any], mode: Mode, kind: str
) -> None:
    clock = _Clock()
    store: Any = MemoryStore(clock=clock) if kind == "memory" else PostgresStore(pool=pool)
    async with store:

        @idempotent_job(store, operation="payouts.send", key="payout_id", mode=mode)
        async def send(job: IdempotencyContext, *, payout_id: str) -> str:
            return job.downstream_key

        first = await send(payout_id="p-1")
        assert await send(payout_id="p-1") == first
        if kind == "memory":
            clock.now += 2 * 24 * 3600.0
        else:
            await _expire(pool)
        again = await send(payout_id="p-1")
    assert again != first
