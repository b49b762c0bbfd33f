"""A duplicate that waited, then found the record `unknown` and asks the route's reconciler,
waits no more: its waiting place (`max_waiters`) is given back before the reconciler runs, so a
slow reconciler does not keep another key's duplicate from waiting (answered 409 at once)."""

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
from idem_middleware.reconcile import Happened
from tests.apps import BOUND, until

pytestmark = pytest.mark.asyncio


async def test_a_duplicate_asking_the_reconciler_gives_its_waiting_place_back() -> None:
    failed, answer, other = asyncio.Event(), asyncio.Event(), asyncio.Event()
    calls = {"x": 0, "y": 0, "reconciler": 0}

    async def x(request: Request) -> JSONResponse:
        calls["x"] += 1
        await failed.wait()
        raise RuntimeError("the original's outcome is unknown")

    async def y(request: Request) -> JSONResponse:
        calls["y"] += 1
        await other.wait()
        return JSONResponse({"ran": "y"}, status_code=201)

    async def reconciler(context: Any) -> Happened:
        calls["reconciler"] += 1
        await answer.wait()  # a slow downstream system
        return Happened(201, b'{"ran": "x"}')

    app = Starlette(routes=[Route("/x", x, methods=["POST"]), Route("/y", y, methods=["POST"])])
    mw = IdempotencyMiddleware(
        app,
        store=MemoryStore(),
        default_policy=Policy(mode=Mode.LEASE, wait_seconds=30),
        policies={"POST /x": Policy(mode=Mode.LEASE, wait_seconds=30, reconciler=reconciler)},
        tenant_resolver=lambda scope: "tenant-a",
        max_waiters=1,
    )
    transport = httpx.ASGITransport(app=mw, raise_app_exceptions=False)
    requests: list[asyncio.Future[httpx.Response]] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:

        def post(path: str, key: str) -> asyncio.Future[httpx.Response]:
            headers = {"idempotency-key": key}
            return asyncio.ensure_future(c.post(path, json={"a": 1}, headers=headers))

        try:
            requests.append(post("/x", "k1"))
            await until(lambda: calls["x"] == 1)
            requests.append(post("/x", "k1"))  # a duplicate: waits in the one place
            await until(lambda: mw.waiters.count == 1)
            failed.set()  # the original raises: the record is unknown
            await until(lambda: calls["reconciler"] == 1)  # the duplicate asks the reconciler
            assert mw.waiters.count == 0  # and waits no more
            requests.append(post("/y", "k2"))
            await until(lambda: calls["y"] == 1)
            requests.append(post("/y", "k2"))  # another key's duplicate: waits, not 409
            await until(lambda: mw.waiters.count == 1 or requests[3].done())
            assert not requests[3].done()
            answer.set()
            other.set()
            answers = await asyncio.wait_for(asyncio.gather(*requests), BOUND)
        finally:
            for event in (failed, answer, other):
                event.set()
            await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), BOUND)
    assert [a.status_code for a in answers] == [500, 201, 201, 201]
    assert answers[1].json() == {"ran": "x"}
    assert calls == {"x": 1, "y": 1, "reconciler": 1}
    assert mw.waiters.count == 0
