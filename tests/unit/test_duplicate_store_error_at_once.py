"""A duplicate whose read of the record fails before it waited at all (the store failed at
once, not during a wait a restart may fall in) is answered 503 at once: it does not poll on
with the record it read before, acting on it again."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from idem_middleware.errors import StoreError
from idem_middleware.store import Claimed
from idem_middleware.store.base import Record, RecordKey

pytestmark = pytest.mark.asyncio


class _FailingRead(MemoryStore):
    """Its first read of a record fails (a connection lost under it)."""

    reads = 0

    async def get(self, key: RecordKey) -> Record | None:
        self.reads += 1
        if self.reads == 1:
            raise StoreError("ConnectionDoesNotExistError: connection was closed")
        return await super().get(key)


async def test_a_duplicates_read_failing_before_it_waited_is_a_503() -> None:
    now = [1_000.0]
    store = _FailingRead(clock=lambda: now[0])
    runs = 0

    async def pay(request: Request) -> JSONResponse:
        nonlocal runs
        runs += 1
        return JSONResponse({}, status_code=201)

    mw = IdempotencyMiddleware(
        Starlette(routes=[Route("/pay", pay, methods=["POST"])]),
        store=store,
        default_policy=Policy(mode=Mode.LEASE, wait_seconds=5),
        tenant_resolver=lambda scope: "t",
    )
    transport = httpx.ASGITransport(app=mw, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        # The original's claim, its lease lapsed (its process gone): the duplicate marks it
        # `unknown` and reads it again at once; that read fails.
        key = RecordKey("t", "POST /pay", "k")
        body: dict[str, Any] = {}
        first = await c.post("/pay", json=body, headers={"idempotency-key": "probe"})
        probe = await MemoryStore.get(store, RecordKey("t", "POST /pay", "probe"))
        assert first.status_code == 201
        assert probe is not None
        claim = await store.claim_lease(
            key, probe.fingerprint, retention_seconds=60, lease_seconds=30
        )
        assert isinstance(claim, Claimed)
        now[0] += 60
        store.reads = 0
        answer = await asyncio.wait_for(
            c.post("/pay", json=body, headers={"idempotency-key": "k"}), 5
        )
    assert answer.status_code == 503
    assert answer.headers["content-type"] == "application/problem+json"
    assert store.reads == 1
    assert runs == 1
