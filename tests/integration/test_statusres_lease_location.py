"""A lease-mode duplicate's `202` names its own request in its `Location` (`&request=`, a digest
of its fingerprint), as a transactional duplicate's does.

Found by probing: a lease-mode duplicate that found the original's record (same request, still
running) got a `Location` without it, on the idea that the record it had compared was the one
the status resource would read. It need not be: the original is answered a "fix and retry" 4xx
(its record released, nothing happened), the client sends the corrected request with the same
key, as the protocol invites, and it succeeds. The first request's `Location` then read that
request's record: `"state": "succeeded", "response_status": 201`, the outcome of a request it
is not, for one that was refused and did nothing. It is now `422 key-reused`.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy, PostgresStore
from idem_middleware.status import status_route
from tests.apps import BOUND, BearerBackend, assert_problem, client, key


@pytest.mark.parametrize("memory", [False, True], ids=["postgres", "memory"])
async def test_a_lease_duplicates_location_never_reads_a_corrected_requests_outcome(
    pool: Any, memory: bool
) -> None:
    store: Any = MemoryStore() if memory else PostgresStore(pool=pool)
    gate, entered = asyncio.Event(), asyncio.Event()

    async def pay(request: Request) -> Response:
        amount = (await request.json())["amount"]
        if amount < 0:  # held, then refused: a "fix and retry" 4xx releases the key
            entered.set()
            await gate.wait()
            return JSONResponse({"error": "negative amount"}, 400)
        return JSONResponse({"paid": amount}, 201)

    policy = Policy(mode=Mode.LEASE, accept_while_in_flight=True, wait_seconds=0.05)
    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"]), status_route(store)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=policy),
        ],
    )
    async with store, client(app) as c:
        first = asyncio.create_task(c.post("/pay", json={"amount": -5}, headers=key("k")))
        await asyncio.wait_for(entered.wait(), BOUND)
        accepted = await c.post("/pay", json={"amount": -5}, headers=key("k"))
        assert accepted.status_code == 202, accepted.text
        location = accepted.headers["location"]
        running = await c.get(location)
        gate.set()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 400
        corrected = await c.post("/pay", json={"amount": 5}, headers=key("k"))
        assert corrected.status_code == 201, corrected.text
        status = await c.get(location)
    assert "request" in parse_qs(urlsplit(location).query), location
    assert running.status_code == 200, running.text  # (its own record then: pending)
    assert running.json()["state"] == "pending"
    # (Was: 200 `succeeded`, `response_status` 201: the corrected request's outcome.)
    assert_problem(status, 422, "key-reused")


async def test_a_lease_duplicate_whose_look_at_the_record_times_out_names_its_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other way a waiting lease-mode duplicate ends in a 202: its read of the record held
    up past its wait (a lock on the table). Its Location names its request all the same."""
    store = MemoryStore()
    gate, entered = asyncio.Event(), asyncio.Event()

    async def pay(request: Request) -> Response:
        entered.set()
        await gate.wait()
        return JSONResponse({"paid": 5}, 201)

    looks: list[Any] = []

    async def held_up(record_key: Any) -> Any:
        looks.append(record_key)
        await asyncio.sleep(BOUND)  # (cut short by the duplicate's own bound)

    policy = Policy(mode=Mode.LEASE, accept_while_in_flight=True, wait_seconds=0.05)
    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"]), status_route(store)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=policy),
        ],
    )
    async with store, client(app) as c:
        first = asyncio.create_task(c.post("/pay", json={"amount": 5}, headers=key("k")))
        await asyncio.wait_for(entered.wait(), BOUND)
        with monkeypatch.context() as patched:
            patched.setattr(store, "get", held_up)
            accepted = await asyncio.wait_for(
                c.post("/pay", json={"amount": 5}, headers=key("k")), BOUND
            )
        gate.set()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
    assert looks, "the duplicate never looked at the record again"
    assert accepted.status_code == 202, accepted.text
    assert "request" in parse_qs(urlsplit(accepted.headers["location"]).query)
