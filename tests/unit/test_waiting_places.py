"""`max_waiters` counts duplicates waiting, not duplicates that waited and went on to run.

Found by probing: a duplicate whose original failed (rolled back, or released) claimed the key
and ran its handler still holding its waiting place, so with `max_waiters=1` a duplicate of
another key, with nobody waiting, was answered `409` at once. Both modes.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from tests.apps import BOUND, until

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_duplicate_that_goes_on_to_run_gives_its_waiting_place_back(mode: Mode) -> None:
    failed, second, other = asyncio.Event(), asyncio.Event(), asyncio.Event()
    calls: dict[str, int] = {"x": 0, "y": 0}

    async def x(request: Request) -> JSONResponse:
        calls["x"] += 1
        if calls["x"] == 1:  # the original: fails, nothing done (rolled back, or released)
            await failed.wait()
            return JSONResponse({}, status_code=500 if mode is Mode.TRANSACTIONAL else 400)
        await second.wait()  # its duplicate, which waited, runs it
        return JSONResponse({"ran": "x"}, status_code=201)

    async def y(request: Request) -> JSONResponse:
        calls["y"] += 1
        await other.wait()
        return JSONResponse({"ran": "y"}, status_code=201)

    app = Starlette(routes=[Route("/x", x, methods=["POST"]), Route("/y", y, methods=["POST"])])
    mw = IdempotencyMiddleware(
        app,
        store=MemoryStore(),
        default_policy=Policy(mode=mode, wait_seconds=30),
        tenant_resolver=lambda scope: "tenant-a",
        max_waiters=1,
    )
    transport = httpx.ASGITransport(app=mw)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:

        def post(path: str, key: str) -> asyncio.Future[httpx.Response]:
            headers = {"idempotency-key": key}
            return asyncio.ensure_future(c.post(path, json={"a": 1}, headers=headers))

        requests = [post("/x", "k1")]
        try:
            await until(lambda: calls["x"] == 1)
            requests.append(post("/x", "k1"))  # a duplicate: waits in the one place
            await until(lambda: mw.waiters.count == 1)
            failed.set()
            await until(lambda: calls["x"] == 2)  # the duplicate runs the request itself
            assert mw.waiters.count == 0  # and waits no more
            requests.append(post("/y", "k2"))
            await until(lambda: calls["y"] == 1)
            requests.append(post("/y", "k2"))  # another key's duplicate: waits, not 409
            await until(lambda: mw.waiters.count == 1)
            second.set()
            other.set()
            answers = await asyncio.wait_for(asyncio.gather(*requests), BOUND)
        finally:
            for event in (failed, second, other):
                event.set()
            await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), BOUND)
    assert [a.status_code for a in answers] == [
        500 if mode is Mode.TRANSACTIONAL else 400,
        201,
        201,
        201,
    ]
    assert answers[3].headers["idempotent-replayed"] == "true"
    assert calls == {"x": 2, "y": 1}
    assert mw.waiters.count == 0
