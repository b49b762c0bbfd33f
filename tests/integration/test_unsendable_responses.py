"""Responses a handler produces that the server refuses to send, behind real uvicorn servers (h11
and httptools) on 127.0.0.1, counted in the database.

Found by probing: a handler putting a client's filename in `Content-Disposition` (a CR LF in it)
committed as `succeeded`; uvicorn refused the head (h11: "Illegal header value", httptools:
"Invalid HTTP header value") and dropped the connection, and every retry replayed the stored
head and was dropped again, for the whole retention. Now the replay leaves such a header out
(the retry gets the outcome). A status that is no final status (1xx, 99, 600, "201") and
messages out of order (a second start, a body before the start or after the end) were stored
and replayed the same way: they are now the handler's exception, raised at its `send`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Policy, get_context
from idem_middleware.policy import Mode
from tests.apps import LEDGER_INSERT, BearerBackend, count, records
from tests.apps.servers import connection, read_response, uvicorn_serving

pytestmark = pytest.mark.asyncio

SERVERS = pytest.mark.parametrize("http", ["h11", "httptools"])


async def _export(request: Request) -> Response:
    """Writes a ledger row (on the claim's connection in transactional mode) and answers with
    the file named as the client asked, as apps do."""
    payload = await request.json()
    request.app.state.calls += 1
    ctx = get_context(request)
    if ctx.connection is not None:
        await ctx.connection.execute(LEDGER_INSERT, ctx.tenant, "a1", 5)
    headers = {"content-disposition": f'attachment; filename="{payload["name"]}"'}
    return Response(b"id,amount\n1,5\n", 201, headers=headers, media_type="text/csv")


def _app(store: Any) -> Starlette:
    app = Starlette(
        routes=[
            Route("/export", _export, methods=["POST"]),
            Route("/lease-export", _export, methods=["POST"]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies={
                    "POST /lease-export": Policy(
                        mode=Mode.LEASE, lease_seconds=5.0, wait_seconds=0.3
                    )
                },
            ),
        ],
    )
    app.state.calls = 0
    return app


def _post(path: str, key: str, name: str) -> bytes:
    body = json.dumps({"name": name}).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: test\r\nauthorization: Bearer demo-a\r\n"
        f"idempotency-key: {key}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _ask(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    async with connection(port) as (reader, writer):
        writer.write(request)
        return await asyncio.wait_for(read_response(reader), 10)


async def _dropped(port: int, request: bytes) -> None:
    """The server refuses the head: the connection closes with no response."""
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        await _ask(port, request)


@SERVERS
@pytest.mark.parametrize("path", ["/export", "/lease-export"])
async def test_a_header_the_server_refuses_is_left_out_of_the_replay(
    pg_store: Any, pool: Any, http: str, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first client's connection drops (the server refuses the head after the outcome was
    recorded: checking every response's headers first costs more than the hot path allows);
    the retry gets the outcome, without the header, and the log names it (never its value)."""
    app = _app(pg_store)
    async with uvicorn_serving(app, http) as port:
        await _dropped(port, _post(path, "k1", "secret\r\nb.csv"))
        with caplog.at_level(logging.WARNING, logger="idem_middleware"):
            replay = await _ask(port, _post(path, "k1", "secret\r\nb.csv"))
        # A clean name on another key: stored and replayed whole, as ever.
        clean = await _ask(port, _post(path, "k2", "b.csv"))
        again = await _ask(port, _post(path, "k2", "b.csv"))
    assert (replay[0], replay[2]) == (201, b"id,amount\n1,5\n")
    assert replay[1][b"idempotent-replayed"] == b"true"
    assert b"content-disposition" not in replay[1]
    assert replay[1][b"content-type"].startswith(b"text/csv")
    assert app.state.calls == 2  # once per key
    assert "content-disposition" in caplog.text
    assert "secret" not in caplog.text
    assert f"POST {path}" in caplog.text  # named by its operation
    assert (clean[0], again[0], again[2]) == (201, 201, clean[2])
    assert again[1][b"content-disposition"] == b'attachment; filename="b.csv"'
    assert [(r["idem_key"], r["state"]) for r in await records(pool)] == [
        ("k1", "succeeded"),
        ("k2", "succeeded"),
    ]
    if path == "/export":
        assert await count(pool, "test_ledger") == 2


async def _raw(scope: Any, receive: Any, send: Any, messages: list[dict[str, Any]]) -> None:
    while (await receive()).get("more_body"):
        pass
    for message in messages:
        await send(message)


def _start(status: Any, headers: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status, "headers": headers or []}


_BODY = {"type": "http.response.body", "body": b"ok"}

#: Statuses and message orders a server refuses (or, a 1xx under httptools, sends as a final
#: response no client can read): each was stored as `succeeded` and replayed as it was.
REFUSED = {
    "status-101": [_start(101), _BODY],
    "status-99": [_start(99), _BODY],
    "status-600": [_start(600), _BODY],
    "status-str": [_start("201"), _BODY],
    "status-bool": [_start(True), _BODY],
    "start-twice": [_start(201), _start(202), _BODY],
    "body-before-start": [_BODY, _start(201), _BODY],
    "body-after-the-end": [_start(201), _BODY, _BODY],
}

#: Headers a server refuses: recorded, then left out of the replay.
REFUSED_HEADERS = {
    "name-with-space": (b"x a", b"v"),
    "name-with-colon": (b"x:a", b"v"),
    "nul-in-value": (b"x-a", b"a\x00b"),
    "control-in-value": (b"x-a", b"a\x01b"),
    "trailing-space": (b"x-a", b"v "),
    "str-value": (b"x-a", "v"),  # (the driver's store wrote no record at all for it)
}


class _Raw:
    def __init__(self, messages: list[dict[str, Any]], calls: list[int]) -> None:
        self.messages = messages
        self.calls = calls

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls.append(1)
        await _raw(scope, receive, send, self.messages)


@SERVERS
@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_a_refused_response_is_never_recorded(
    pg_store: Any, pool: Any, http: str, case: str, mode: Mode
) -> None:
    """Transactional: a 500, rolled back, and the retry runs again. Lease mode: a 500, and the
    retry is told the outcome is unknown (a status that is not an int, "201", left the claim
    `pending` until its lease ran out: its settlement raised after the handler returned)."""
    calls: list[int] = []
    policy = Policy(mode=mode, lease_seconds=5.0, wait_seconds=0.3)
    app = Starlette(
        routes=[Route("/raw", _Raw(REFUSED[case], calls), methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=pg_store, default_policy=policy),
        ],
    )
    async with uvicorn_serving(app, http) as port:
        first = await _ask(port, _post("/raw", "k", "x"))
        retry = await _ask(port, _post("/raw", "k", "x"))
    assert first[0] == 500
    if mode is Mode.TRANSACTIONAL:
        assert (retry[0], len(calls)) == (500, 2)
        assert await records(pool) == []
    else:
        assert (retry[0], len(calls)) == (409, 1)
        assert json.loads(retry[2])["type"].endswith("outcome-unknown")
        assert [r["state"] for r in await records(pool)] == ["unknown"]


@SERVERS
@pytest.mark.parametrize("case", sorted(REFUSED_HEADERS))
async def test_a_refused_header_is_recorded_and_left_out_of_the_replay(
    pg_store: Any, pool: Any, http: str, case: str
) -> None:
    calls: list[int] = []
    header = REFUSED_HEADERS[case]
    messages = [_start(201, [(b"x-kept", b"yes"), header]), _BODY]
    app = Starlette(
        routes=[Route("/raw", _Raw(messages, calls), methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=pg_store),
        ],
    )
    async with uvicorn_serving(app, http) as port:
        if (case, http) in {
            ("control-in-value", "h11"),
            ("trailing-space", "httptools"),
            ("str-value", "h11"),
        }:
            # (The one server sends it; the other refuses it: no replay may carry it.)
            assert (await _ask(port, _post("/raw", "k", "x")))[0] == 201
        else:
            await _dropped(port, _post("/raw", "k", "x"))
        replay = await _ask(port, _post("/raw", "k", "x"))
    assert (replay[0], replay[2], replay[1][b"x-kept"]) == (201, b"ok", b"yes")
    if case == "trailing-space":  # the same field to HTTP: replayed without the space
        assert replay[1][b"x-a"] == b"v"
    else:
        assert header[0].lower() not in replay[1]
    assert len(calls) == 1
