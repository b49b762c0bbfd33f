"""A lease-mode response that cannot be held (a stream, a body over the cap) is settled before
its first byte (`settle_early`); that settlement meeting a blip (the store's PostgreSQL stopped
and started again, tests/restarts.py) is sent again as a held response's is (resettle.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from idem_middleware import get_context
from idem_middleware.store.base import State
from tests.apps import assert_problem, client, one_route_app
from tests.integration.test_settlement_blips import (
    BOUND,
    HEADERS,
    KEY,
    POLICY,
    LoseFencedAnswer,
    SettleLog,
    until,
)
from tests.restarts import OwnServer

CHUNKS = [b'{"charged": ', b"true}"]


def streamed(how: str, fence: bool) -> tuple[object, asyncio.Event, asyncio.Event]:
    entered, release = asyncio.Event(), asyncio.Event()

    async def charge(request: Request) -> Response:
        if fence:
            conn = await get_context(request).fenced_connection()
            await conn.execute("SELECT 1")
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        if how == "over-cap":
            return JSONResponse({"charged": True, "pad": "x" * 64}, status_code=201)

        async def body() -> AsyncIterator[bytes]:
            for chunk in CHUNKS:
                yield chunk

        return StreamingResponse(body(), status_code=201, media_type="text/event-stream")

    return charge, entered, release


def policy_for(how: str) -> object:
    return POLICY.replace(max_response_bytes=16) if how == "over-cap" else POLICY


@pytest.mark.parametrize("how", ["stream", "over-cap"])
async def test_an_early_settlement_sent_while_the_server_restarts_is_recorded_and_streamed(
    own_server: OwnServer, own_dsn: str, how: str
) -> None:
    """The handler (no fenced transaction) answers with a stream while the server is down: its
    early settlement failed once, the record was marked `unknown` and the client answered 503,
    for a charge that happened. Now the same compare-and-set is sent again, and once the
    server is back the outcome is recorded and the response streamed."""
    charge, entered, release = streamed(how, fence=False)
    async with SettleLog(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        store.settlements = []
        app = one_route_app(
            "/charges", charge, store=store, policies={"POST /charges": policy_for(how)}
        )
        async with client(app) as c:
            first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await asyncio.wait_for(entered.wait(), BOUND)
            await asyncio.to_thread(own_server.stop)
            try:
                release.set()
                await until(lambda: store.settlements, "a settlement tried with the server down")
            finally:
                await asyncio.to_thread(own_server.start)
            response = await asyncio.wait_for(first, BOUND)
            assert response.status_code == 201, response.text
            assert response.json()["charged"] is True
            assert store.settlements[0] == (State.SUCCEEDED, False)
            assert store.settlements[-1] == (State.SUCCEEDED, True)
            assert {state for state, _ in store.settlements} == {State.SUCCEEDED}
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.SUCCEEDED
            retry = await c.post("/charges", json={}, headers=HEADERS)
            assert retry.status_code == 201
            assert retry.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize("how", ["stream", "over-cap"])
async def test_a_fenced_early_settlement_whose_answer_was_lost_after_it_committed_streams(
    own_dsn: str, how: str
) -> None:
    """The fenced transaction committed with the early settlement, and the answer to its
    COMMIT was lost: the client was answered 409 (this execution lost its claim) for a request
    whose writes and outcome were committed. Now the record is read: it holds this generation's
    outcome, so the response streams."""
    charge, _, release = streamed(how, fence=True)
    release.set()
    async with LoseFencedAnswer(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        policies = {"POST /charges": policy_for(how)}
        app = one_route_app("/charges", charge, store=store, policies=policies)
        async with client(app) as c:
            response = await asyncio.wait_for(c.post("/charges", json={}, headers=HEADERS), BOUND)
            assert response.status_code == 201, response.text
            assert response.json()["charged"] is True
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.SUCCEEDED


async def test_a_fenced_early_settlement_that_failed_is_not_sent_again(
    own_server: OwnServer, own_dsn: str
) -> None:
    """With a fenced transaction, the failed early settlement's COMMIT took the handler's writes
    with it: nothing is streamed nor recorded alone; the record is marked `unknown` once the
    server is back, and the client answered 503."""
    charge, entered, release = streamed("stream", fence=True)
    async with SettleLog(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        store.settlements = []
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": POLICY})
        async with client(app) as c:
            first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await asyncio.wait_for(entered.wait(), BOUND)
            await asyncio.to_thread(own_server.stop)
            try:
                release.set()
                await until(lambda: store.settlements, "an unknown mark tried with the server down")
            finally:
                await asyncio.to_thread(own_server.start)
            response = await asyncio.wait_for(first, BOUND)
            assert_problem(response, 503, "store-unavailable")
            assert {state for state, _ in store.settlements} == {State.UNKNOWN}
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.UNKNOWN
