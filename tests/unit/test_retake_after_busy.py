"""A duplicate whose reconciler answered "not happened" but found the record held by another
session (another process's reconciler in its fence: ClaimBusy) waits, then takes the record
over and runs it: the reconciler is not asked again (each ask may call the downstream system,
and it already answered)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from idem_middleware.reconcile import NotHappened
from idem_middleware.store.base import RecordKey, State
from tests.apps import BOUND, until

pytestmark = pytest.mark.asyncio


async def test_not_happened_over_a_busy_record_takes_it_over_without_asking_again() -> None:
    store = MemoryStore()
    calls = {"x": 0, "reconciler": 0}
    other = contextlib.AsyncExitStack()  # another session's fence on the record

    async def x(request: Request) -> JSONResponse:
        calls["x"] += 1
        if calls["x"] == 1:
            raise RuntimeError("the original's outcome is unknown")
        return JSONResponse({"ran": calls["x"]}, status_code=201)

    async def reconciler(context: Any) -> NotHappened:
        calls["reconciler"] += 1
        if calls["reconciler"] == 1:  # meanwhile another process's reconciler holds it
            key = RecordKey(context.tenant, context.operation, context.key)
            await other.enter_async_context(store.fenced(key, context.generation, State.UNKNOWN))
        return NotHappened()

    app = Starlette(routes=[Route("/x", x, methods=["POST"])])
    mw = IdempotencyMiddleware(
        app,
        store=store,
        default_policy=Policy(mode=Mode.LEASE, wait_seconds=30, reconciler=reconciler),
        tenant_resolver=lambda scope: "tenant-a",
    )
    transport = httpx.ASGITransport(app=mw, raise_app_exceptions=False)
    headers = {"idempotency-key": "k1"}
    async with other, httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        first = await asyncio.wait_for(c.post("/x", json={}, headers=headers), BOUND)
        assert first.status_code == 500  # the record is unknown
        retry = asyncio.ensure_future(c.post("/x", json={}, headers=headers))
        try:
            await until(lambda: mw.waiters.count == 1)  # busy: it waits
            assert calls == {"x": 1, "reconciler": 1}
            await other.aclose()  # the other session is done, the record still unknown
            answer = await asyncio.wait_for(retry, BOUND)
        finally:
            await other.aclose()
            await asyncio.wait_for(asyncio.gather(retry, return_exceptions=True), BOUND)
    assert answer.status_code == 201
    assert calls == {"x": 2, "reconciler": 1}
