"""The 202's Location of a FastAPI app with a root path of its own, wrapped by hand
(`IdempotencyMiddleware(FastAPI(root_path="/api"), ...)`), is under that root path: FastAPI sets
the scope's root path only as it is called, after the middleware answered the duplicate, so the
scope's was "" and the Location, `/idempotency/status?...`, named no route of the app's."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.status import status_route
from tests.apps import BOUND, BearerBackend, client, key


async def test_the_location_is_under_the_wrapped_apps_own_root_path() -> None:
    from fastapi import FastAPI

    store = MemoryStore()
    gate, entered = asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> Response:
        entered.set()
        await gate.wait()
        return JSONResponse({}, 201)

    with warnings.catch_warnings():  # (deprecated in newer FastAPI, and applied all the same)
        warnings.simplefilter("ignore")
        api = FastAPI(root_path="/api")
    api.add_api_route("/pay", slow, methods=["POST"])
    api.router.routes.append(status_route(store))
    guarded = IdempotencyMiddleware(
        api, store=store, default_policy=Policy(accept_while_in_flight=True, wait_seconds=0.05)
    )
    app: Any = AuthenticationMiddleware(guarded, backend=BearerBackend())
    async with client(app) as c:
        first = asyncio.create_task(c.post("/api/pay", json={}, headers=key("k")))
        await asyncio.wait_for(entered.wait(), BOUND)
        duplicate = await c.post("/api/pay", json={}, headers=key("k"))
        assert duplicate.status_code == 202, duplicate.text
        status = await c.get(duplicate.headers["location"])
        gate.set()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
    assert duplicate.headers["location"].startswith("/api/idempotency/status?")
    assert status.status_code == 200, status.text
