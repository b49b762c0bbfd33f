"""The app's work after a response that settled before its first byte (a stream, or a response
over `max_response_bytes`): a `BackgroundTask`, a dependency's teardown. Servers (uvicorn,
hypercorn) answer `receive()` with `http.disconnect` once the response is complete; the
transactional client watch, started after `DISCONNECT_WATCH_AFTER`, took that for the client
leaving and cancelled the request's task, silently: the task was cut short while its record said
`succeeded`, and every retry got the replay. Lease mode and unguarded routes ran it to its end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from idem_middleware import Policy, PostgresStore, get_context
from idem_middleware.store.base import RecordKey, State
from idem_middleware.transactional import DISCONNECT_WATCH_AFTER
from tests.apps import BOUND, AsServer, asgi_request, one_route_app

#: How long the background task works: past the moment the client watch starts.
WORK_SECONDS = DISCONNECT_WATCH_AFTER + 0.3


async def _events() -> AsyncIterator[bytes]:
    yield b"data: one\n\n"


@pytest.mark.parametrize("response", ["event stream", "over max_response_bytes"])
async def test_work_after_a_settled_stream_runs_to_its_end(
    pg_store: PostgresStore, response: str
) -> None:
    finished: list[str] = []

    async def work() -> None:
        await asyncio.sleep(WORK_SECONDS)
        finished.append("finished")

    async def handler(request: Request) -> Response:
        get_context(request)  # (under the claim)
        task = BackgroundTask(work)
        if response == "event stream":
            return StreamingResponse(_events(), media_type="text/event-stream", background=task)
        return JSONResponse({"padding": "x" * 200}, status_code=201, background=task)

    policy = Policy(max_response_bytes=100)
    app = one_route_app("/work", handler, store=pg_store, policies={"POST /work": policy})
    server = AsServer(b"{}")
    request = app(asgi_request("/work", "after", len(server.body)), server.receive, server.send)
    await asyncio.wait_for(request, BOUND)
    assert server.complete.is_set()
    assert finished == ["finished"]  # (cancelled by the watch, it was [])
    record = await pg_store.get(RecordKey("tenant-a", "POST /work", "after"))
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.response is not None
    assert record.response.body_omitted is not None
    if response == "over max_response_bytes":
        assert json.loads(server.sent_body()) == {"padding": "x" * 200}


async def test_a_settled_stream_stops_once_its_client_leaves(pg_store: PostgresStore) -> None:
    """The other side: a client leaving mid-stream still ends an endless stream, through the
    app's receive() (Starlette's streaming response waits on it from before its first byte),
    once the watch starts; the outcome stays committed. (Out of the watch altogether, the app's
    receive() waited for a verdict nothing gave, and the stream ran on for good.)"""
    produced: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        for n in range(int(BOUND / 0.01)):  # (bounded: the test's own bound)
            produced.append(n)
            yield b"data: %d\n\n" % n
            await asyncio.sleep(0.01)

    async def handler(request: Request) -> Response:
        get_context(request)
        return StreamingResponse(endless(), media_type="text/event-stream")

    app = one_route_app("/work", handler, store=pg_store)
    server = AsServer(b"{}", leaves_after=3)
    request = app(asgi_request("/work", "leaves", len(server.body)), server.receive, server.send)
    await asyncio.wait_for(request, BOUND)
    # It stopped once the watch read the disconnect (after DISCONNECT_WATCH_AFTER), far short of
    # the generator's end.
    assert len(produced) < (DISCONNECT_WATCH_AFTER + 1.0) / 0.01
    record = await pg_store.get(RecordKey("tenant-a", "POST /work", "leaves"))
    assert record is not None
    assert record.state is State.SUCCEEDED
