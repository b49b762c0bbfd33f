"""README.md's "What a request gets", the in-flight row with another fingerprint: lease mode
answers `422 key-reused` at once (the claim's fingerprint is committed); transactional mode
cannot read an uncommitted claim's fingerprint, so a duplicate whose wait runs out before the
original commits gets `409 request-in-flight` (docs/protocol.md), not the `422` the README said."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy
from tests.apps import BOUND, assert_problem, key
from tests.apps.clients import client, one_route_app


def _held_app(store: Any, policy: Policy) -> tuple[Any, asyncio.Event, asyncio.Event]:
    entered, release = asyncio.Event(), asyncio.Event()

    async def pay(request: Request) -> Response:
        await request.body()
        entered.set()
        await release.wait()
        return JSONResponse({"ok": True}, 201)

    return one_route_app("/pay", pay, store=store, default_policy=policy), entered, release


async def _other_body_while_held(store: Any, policy: Policy) -> tuple[Response, float]:
    app, entered, release = _held_app(store, policy)
    async with client(app) as c:
        first = asyncio.create_task(c.post("/pay", json={"a": 1}, headers=key("k")))
        await asyncio.wait_for(entered.wait(), BOUND)
        loop = asyncio.get_running_loop()
        started = loop.time()
        other = await asyncio.wait_for(c.post("/pay", json={"a": 2}, headers=key("k")), BOUND)
        took = loop.time() - started
        release.set()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
    return other, took


async def test_transactional_another_body_past_the_wait_is_409_in_flight(pg_store: Any) -> None:
    other, took = await _other_body_while_held(pg_store, Policy(wait_seconds=0.3))
    assert_problem(other, 409, "request-in-flight")
    assert other.headers["retry-after"] == "1"
    assert took >= 0.3


async def test_lease_mode_another_body_in_flight_is_422_at_once(pg_store: Any) -> None:
    policy = Policy(mode=Mode.LEASE, lease_seconds=30, wait_seconds=3.0)
    other, took = await _other_body_while_held(pg_store, policy)
    assert_problem(other, 422, "key-reused")
    assert took < 3.0
