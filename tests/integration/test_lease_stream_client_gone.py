"""Lease mode: the client leaves while its handler's response is produced. Starlette's streaming
response listens for the disconnect (under a server of ASGI spec below 2.4, uvicorn's) and
cancels the stream when it comes. The handler had run, so the outcome is recorded, never left
`unknown`: a stream's early settlement is not cut off in flight (it was, and the record was
marked `unknown` with a 500), and a held response the disconnect ended is recorded by its
status, the body omitted, as a stream's. A retry gets the replay."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from idem_middleware import Mode, Policy, PostgresStore
from idem_middleware.errors import StatementRefused, StoreError
from idem_middleware.store.base import RecordKey, Settlement, State
from tests.apps import BOUND, asgi_request, client, one_route_app

KEY = RecordKey("tenant-a", "POST /charges", "k1")
BODY = b"{}"
POLICY = Policy(mode=Mode.LEASE, lease_seconds=30, max_response_bytes=1_000)


class Gone:
    """The server's side: the body, then the client's disconnect once `leave` is set."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self.delivered = False

    async def receive(self) -> dict[str, Any]:
        if not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.wait_for(self.leave.wait(), BOUND)
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def _run(app: Any, server: Gone) -> None:
    scope = asgi_request("/charges", KEY.key, len(BODY))
    await asyncio.wait_for(app(scope, server.receive, server.send), BOUND)


async def test_a_streams_early_settlement_is_not_cut_off_by_its_client_leaving(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = Gone()
    settle = pg_store.settle
    calls: list[int] = []

    async def settling(*args: Any, **kwargs: Any) -> bool:
        calls.append(1)
        server.leave.set()  # the client leaves as the outcome is being recorded
        await asyncio.sleep(0.05)  # (its disconnect reaches the response meanwhile)
        return await settle(*args, **kwargs)

    monkeypatch.setattr(pg_store, "settle", settling)
    runs: list[int] = []

    async def charge(request: Request) -> Response:
        await request.body()
        runs.append(1)

        async def events() -> AsyncIterator[bytes]:
            yield b"data: charged\n\n"

        return StreamingResponse(events(), status_code=201, media_type="text/event-stream")

    app = one_route_app("/charges", charge, store=pg_store, policies={"POST /charges": POLICY})
    await _run(app, server)
    record = await pg_store.get(KEY)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.response is not None
    assert (record.response.status, record.response.body_omitted) == (201, "streaming")
    assert calls == [1]  # recorded once: not cut off in flight (then recorded again)
    monkeypatch.setattr(pg_store, "settle", settle)
    async with client(app) as c:
        retry = await c.post("/charges", json={}, headers={"idempotency-key": KEY.key})
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert runs == [1]


async def test_a_held_response_its_client_cut_short_is_recorded_by_its_status(
    pg_store: PostgresStore,
) -> None:
    server = Gone()
    runs: list[int] = []

    async def charge(request: Request) -> Response:
        await request.body()
        runs.append(1)

        async def chunks() -> AsyncIterator[bytes]:
            yield b"x" * 100  # (under the cap: held)
            server.leave.set()  # the client leaves before the rest
            await asyncio.sleep(BOUND)
            yield b"never"

        return StreamingResponse(chunks(), status_code=201, media_type="application/octet-stream")

    app = one_route_app("/charges", charge, store=pg_store, policies={"POST /charges": POLICY})
    await _run(app, server)
    assert [m["type"] for m in server.sent] == []  # nothing for a client who left
    record = await pg_store.get(KEY)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.response is not None
    assert (record.response.status, record.response.body_omitted) == (201, "streaming")
    async with client(app) as c:
        retry = await c.post("/charges", json={}, headers={"idempotency-key": KEY.key})
        again = await c.post("/charges", json={}, headers={"idempotency-key": KEY.key})
    for replay in (retry, again):
        assert replay.status_code == 201
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.headers["idempotency-body-omitted"] == "streaming"
    assert runs == [1]


async def test_a_cut_short_response_whose_settlement_is_refused_leaves_the_record_unknown(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the database refuses a cut-short response's settlement (a trigger, a constraint:
    sending it again cannot help), the record is marked `unknown`, not left `pending` until its
    lease lapses (then taken over and the handler run again on a takeover route)."""
    server = Gone()
    real_settle = pg_store.settle
    refused: list[State] = []

    async def settle(key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if s.state is State.SUCCEEDED:
            refused.append(s.state)
            raise StatementRefused("CheckViolationError: refused by a trigger")
        return await real_settle(key, generation, expected, s)

    monkeypatch.setattr(pg_store, "settle", settle)

    async def charge(request: Request) -> Response:
        await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            yield b"x" * 100  # (under the cap: held)
            server.leave.set()  # the client leaves before the rest
            await asyncio.sleep(BOUND)
            yield b"never"

        return StreamingResponse(chunks(), status_code=201, media_type="application/octet-stream")

    app = one_route_app("/charges", charge, store=pg_store, policies={"POST /charges": POLICY})
    with contextlib.suppress(StoreError):  # (the refusal reaches the server, or a 5xx does)
        await _run(app, server)
    assert refused == [State.SUCCEEDED]
    record = await pg_store.get(KEY)
    assert record is not None
    assert record.state is State.UNKNOWN
