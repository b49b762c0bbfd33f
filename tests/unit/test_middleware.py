"""The middleware on the in-memory store, driven through httpx's ASGI transport: no PostgreSQL.

The protocol as a client sees it (claim then replay, a reused key, a missing key, a duplicate of
a request in flight, a response that cannot be held, tenants apart); the HTTP suites in
tests/integration run the same protocol on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, idempotent
from idem_middleware.fastapi import IdempotencyConnection
from idem_middleware.store import RecordKey, State
from tests.apps import (
    Held,
    assert_problem,
    assert_replay_of,
    build_app,
    client,
    key,
    wait_entered,
)

CREDIT = "/accounts/a1/credits"


def memory_app(**policy: float) -> tuple[Any, MemoryStore]:
    store = MemoryStore()
    return build_app(store, default_policy=Policy(**policy)), store


async def test_a_claimed_request_runs_once_and_its_duplicate_is_replayed() -> None:
    app, _ = memory_app()
    async with client(app) as c:
        first = await c.post(CREDIT, json={"amount": 5}, headers=key("k1"))
        again = await c.post(CREDIT, json={"amount": 5}, headers=key("k1"))
    assert first.status_code == 201
    assert first.json()["call"] == 1
    assert_replay_of(again, first)
    assert app.state.probe.calls == 1


async def test_a_key_reused_with_another_body_is_422_and_does_not_run() -> None:
    app, _ = memory_app()
    async with client(app) as c:
        first = await c.post(CREDIT, json={"amount": 5}, headers=key("k1"))
        other = await c.post(CREDIT, json={"amount": 6}, headers=key("k1"))
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert app.state.probe.calls == 1


async def test_a_missing_key_is_400_and_does_not_run() -> None:
    app, _ = memory_app()
    async with client(app) as c:
        r = await c.post(CREDIT, json={"amount": 5})
    assert_problem(r, 400, "missing-key")
    assert app.state.probe.calls == 0


async def test_a_duplicate_of_a_request_in_flight_is_409_with_retry_after() -> None:
    app, _ = memory_app(wait_seconds=0.05)
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json={"amount": 5}, headers=key("k1")))
        await wait_entered(probe)
        duplicate = await c.post(CREDIT, json={"amount": 5}, headers=key("k1"))
        held.release()
        original = await first
    assert_problem(duplicate, 409, "request-in-flight")
    assert int(duplicate.headers["retry-after"]) >= 1
    assert original.status_code == 201
    assert probe.calls == 1


async def test_a_stream_settles_before_its_first_byte_and_is_replayed_without_its_body() -> None:
    app, store = memory_app()
    async with client(app) as c:
        first = await c.post("/stream", headers=key("s1"))
        again = await c.post("/stream", headers=key("s1"))
    assert first.status_code == 200
    assert first.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotency-body-omitted"] == "streaming"
    assert again.content == b""
    assert app.state.probe.calls == 1
    record = await store.get(RecordKey("tenant-a", "POST /stream", "s1"))
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.response is not None
    assert record.response.body_omitted == "streaming"


@pytest.mark.parametrize("token", ["demo-a", "demo-b"])
async def test_tenants_have_key_spaces_of_their_own(token: str) -> None:
    """The same key from another tenant is another request; each tenant's duplicate replays."""
    app, _ = memory_app()
    async with client(app, token="demo-a") as a, client(app, token=token) as b:
        first = await a.post(CREDIT, json={"amount": 5}, headers=key("shared"))
        second = await b.post(CREDIT, json={"amount": 5}, headers=key("shared"))
    assert first.status_code == 201
    if token == "demo-a":
        assert_replay_of(second, first)
        assert app.state.probe.calls == 1
    else:
        assert second.status_code == 201
        assert "idempotent-replayed" not in second.headers
        assert app.state.probe.calls == 2


async def test_a_duplicate_that_runs_after_the_original_was_released_sees_no_error() -> None:
    """The first attempt found the key busy (an exception inside the middleware); the attempt
    that runs the handler later does so outside its handling, so the handler sees no exception
    in flight, and one it raises is not chained to the middleware's."""
    import asyncio
    import sys

    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from tests.apps.clients import one_route_app

    gate = asyncio.Event()
    entered = asyncio.Event()
    seen: list[Any] = []

    async def handler(request: Request) -> JSONResponse:
        seen.append(sys.exc_info()[1])
        entered.set()
        if len(seen) == 1:
            await gate.wait()
            return JSONResponse({"failed": True}, status_code=503)  # released: not recorded
        return JSONResponse({"ran": len(seen)}, status_code=201)

    app = one_route_app("/pay", handler, store=MemoryStore(), default_policy=Policy(wait_seconds=5))
    async with client(app) as c:
        first = asyncio.ensure_future(c.post("/pay", json={"a": 1}, headers=key("k1")))
        await asyncio.wait_for(entered.wait(), 5)
        duplicate = asyncio.ensure_future(c.post("/pay", json={"a": 1}, headers=key("k1")))
        await asyncio.sleep(0.05)  # the duplicate finds the key busy and waits
        assert not duplicate.done()
        assert len(seen) == 1
        gate.set()
        assert (await first).status_code == 503
        second = await duplicate
    assert second.status_code == 201
    assert second.json() == {"ran": 2}
    assert seen == [None, None]


async def test_a_decorated_endpoint_with_an_optional_key_runs_when_none_is_sent() -> None:
    """No key, and the policy does not require one: the request goes to the app unguarded, and
    a decorated endpoint must know the middleware handled it (it refuses to run otherwise)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from idem_middleware import idempotent
    from tests.apps.clients import one_route_app

    @idempotent(key_required=False)
    async def handler(request: Request) -> JSONResponse:
        return JSONResponse({"ran": True}, status_code=201)

    app = one_route_app("/pay", handler, store=MemoryStore())
    async with client(app) as c:
        r = await c.post("/pay", json={"a": 1})
    assert r.status_code == 201
    assert r.json() == {"ran": True}


async def test_a_decorated_endpoint_runs_when_the_middleware_is_switched_off() -> None:
    """The kill switch: the middleware passes every request on, and says it handled them."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from idem_middleware import idempotent
    from tests.apps.clients import one_route_app

    @idempotent()
    async def handler(request: Request) -> JSONResponse:
        return JSONResponse({"ran": True}, status_code=201)

    app = one_route_app("/pay", handler, store=MemoryStore(), enabled=False)
    async with client(app) as c:
        r = await c.post("/pay", json={"a": 1}, headers=key("k1"))
    assert r.status_code == 201
    assert r.json() == {"ran": True}


async def test_the_middleware_as_the_outermost_app_is_served_as_an_asgi3_app() -> None:
    """Its `__call__` returns the coroutine that handles the request (one frame fewer under
    every await of a handler), so it is marked a coroutine function: servers and test clients
    tell an ASGI 3 app by it, and would call anything else with the scope alone (ASGI 2)."""
    from hypercorn.utils import is_asgi
    from starlette._utils import is_async_callable  # what Starlette's TestClient asks
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from uvicorn.config import Config

    from idem_middleware import IdempotencyMiddleware

    calls = []

    async def pay(request: Request) -> JSONResponse:
        calls.append(await request.json())
        return JSONResponse({"call": len(calls)}, status_code=201)

    inner = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    outermost = IdempotencyMiddleware(
        inner, store=MemoryStore(), tenant_resolver=lambda scope: "t1"
    )
    config = Config(app=outermost)
    config.load()
    assert config.interface == "asgi3"
    assert is_async_callable(outermost)
    # hypercorn asks `inspect` (on Python 3.11 it served the middleware as a WSGI app: a 500
    # for every request); asgiref (daphne) asks asyncio, as uvicorn does.
    assert is_asgi(outermost)
    assert inspect.iscoroutinefunction(outermost.__call__)
    assert asyncio.iscoroutinefunction(outermost.__call__)
    async with client(outermost) as c:  # type: ignore[arg-type]
        first = await c.post("/pay", json={"a": 1}, headers=key("k1"))
        again = await c.post("/pay", json={"a": 1}, headers=key("k1"))
    async with client(outermost.__call__) as c:  # (what hypercorn found, called as such)
        third = await c.post("/pay", json={"a": 1}, headers=key("k1"))
    assert first.status_code == 201
    assert_replay_of(again, first)
    assert_replay_of(third, first)
    assert calls == [{"a": 1}]


async def test_an_endpoint_needing_a_claim_under_the_kill_switch_says_it_is_switched_off() -> None:
    """Switched off, the middleware passes requests through, so `IdempotencyConnection` finds
    no claim: its error asked only whether the middleware was installed, which it is. It names
    the switch too."""
    app = FastAPI()

    @app.post("/pay")
    @idempotent()
    async def pay(conn: IdempotencyConnection) -> dict[str, str]:
        return {"ran": "yes"}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), enabled=False)
    transport = httpx.ASGITransport(app=app)  # (raises the app's exception)
    with pytest.raises(RuntimeError, match="IDEM_MIDDLEWARE_DISABLED or enabled=False"):
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            await c.post("/pay", json={"a": 1}, headers=key("k1"))
