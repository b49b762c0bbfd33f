"""What a replay carries, compared with what the first response gave, behind real uvicorn on
127.0.0.1 (spoken to over raw sockets, so that every header line is seen) and in-process, on
PostgreSQL. The rules are in docs/protocol.md ("How the handler's response maps to an outcome")
and docs/decisions.md ("Responses").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from idem_middleware import Mode, Policy
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation
from idem_middleware.store.base import StoredResponse
from idem_middleware.store.postgres import decode_headers
from tests.apps import (
    BOUND,
    PAYOUTS,
    Step,
    build_lease_app,
    client,
    key,
    one_route_app,
    reset_downstream,
)
from tests.apps.servers import connection, uvicorn_serving

PAYOUT = b'{"account": "acc-1", "amount": 100}'


def post(path: str, key: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: test\r\nauthorization: Bearer demo-a\r\n"
        f"idempotency-key: {key}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def exchange(port: int, request: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One request on a connection of its own: the status, every header line (lower-case names,
    in order, repeats kept) and the body its Content-Length frames."""
    async with connection(port) as (reader, writer):
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
        status_line, *lines = head.removesuffix(b"\r\n\r\n").split(b"\r\n")
        headers = []
        for line in lines:
            name, _, value = line.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        lengths = [int(v) for n, v in headers if n == b"content-length"]
        body = await asyncio.wait_for(reader.readexactly(lengths[0] if lengths else 0), BOUND)
        return int(status_line.split()[1]), headers, body


def named(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for n, value in headers if n == name]


async def downstream_headers(rc: ReconcileContext) -> Reconciliation:
    """A reconciler that passes on the bank's HTTP response as it got it (`response.headers.raw`
    of an httpx response): its framing, its connection's headers, its Date, its cookie."""
    return Happened(
        201,
        b'{"reconciled": true}',
        [
            (b"Content-Type", b"application/json"),
            (b"Content-Length", b"4096"),
            (b"Transfer-Encoding", b"chunked"),
            (b"Connection", b"keep-alive"),
            (b"Date", b"Mon, 01 Jan 2001 00:00:00 GMT"),
            (b"Server", b"bank"),
            (b"Set-Cookie", b"bank_session=s3cr3t"),
            (b"X-Bank-Reference", b"r-1"),
        ],
    )


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_reconciled_response_is_stored_as_a_handlers_would_be(
    pg_store: Any, pool: Any, http: str
) -> None:
    """Found by probing: a `Happened` response's headers were stored as given, so a reconciler
    that passed on the downstream's own (Content-Length, Transfer-Encoding ...) made every
    retry for the whole retention a broken response: h11 dropped the connection ("conflicting
    Content-Length headers"), httptools sent two lengths. They are now stored as a handler's
    headers are, and the replay states its own length."""
    await reset_downstream(pool)
    policy = Policy(mode=Mode.LEASE, lease_seconds=5.0, reconciler=downstream_headers)
    app = build_lease_app(pg_store, pool, policy)
    app.state.probe.steps = [Step(fail="after")]  # the bank took it; its answer was lost
    async with uvicorn_serving(app, http) as port:
        first, _, _ = await exchange(port, post(PAYOUTS, "k1", PAYOUT))
        assert first == 500
        for _ in range(2):  # the retry that reconciles, then a replay of the stored record
            status, headers, body = await exchange(port, post(PAYOUTS, "k1", PAYOUT))
            assert status == 201
            assert body == b'{"reconciled": true}'
            assert named(headers, b"content-length") == [str(len(body)).encode()]
            assert named(headers, b"transfer-encoding") == []
            assert named(headers, b"set-cookie") == []
            assert named(headers, b"server") == [b"uvicorn"]  # the server's, once
            assert len(named(headers, b"date")) == 1
            assert named(headers, b"date") != [b"Mon, 01 Jan 2001 00:00:00 GMT"]
            assert named(headers, b"x-bank-reference") == [b"r-1"]
            assert named(headers, b"idempotent-replayed") == [b"true"]
    assert app.state.probe.calls == 1
    stored = await pool.fetchval("SELECT response_headers FROM idem_requests")
    assert {name.lower() for name, _ in decode_headers(stored)} == {
        b"content-type",
        b"x-bank-reference",
    }


async def refilled_buffer(request: Request) -> Response:
    """Streams one buffer, refilled between chunks (as a reader with `readinto` would)."""
    buffer = bytearray(b"AAAA")

    async def chunks() -> AsyncIterator[memoryview]:
        for fill in (b"AAAA", b"BBBB", b"CCCC"):
            buffer[:] = fill
            yield memoryview(buffer)

    return StreamingResponse(chunks(), media_type="application/octet-stream")


async def test_a_stream_of_views_of_one_buffer_is_held_and_replayed_as_sent(pg_store: Any) -> None:
    """Found by probing: each chunk was held by reference, so the first client and every
    replay got `CCCCCCCCCCCC`."""
    app = one_route_app("/export", refilled_buffer, store=pg_store, default_policy=Policy())
    async with client(app) as c:
        first = await c.post("/export", headers=key("k1"))
        replay = await c.post("/export", headers=key("k1"))
    assert first.content == replay.content == b"AAAABBBBCCCC"
    assert replay.headers["idempotent-replayed"] == "true"


async def two_cookies(request: Request) -> Response:
    response = Response(b"ok", media_type="text/plain", headers={"x-order": "o-1"})
    response.set_cookie("session", "first-client")
    response.set_cookie("csrf", "t-1")
    return response


def fresh_cookie(stored: StoredResponse, scope: Any) -> StoredResponse:
    return StoredResponse(
        stored.status, [*stored.headers, (b"set-cookie", b"csrf=t-2")], stored.body
    )


@pytest.mark.parametrize("hook", [None, fresh_cookie], ids=["no-hook", "hook"])
async def test_a_replay_sets_no_cookie_of_the_first_clients(pg_store: Any, hook: Any) -> None:
    """docs/decisions.md, "A replay has no Set-Cookie": none of the first response's cookies,
    however many; a replay hook may set one made for the retry."""
    policy = Policy(replay_hook=hook)
    app = one_route_app("/orders", two_cookies, store=pg_store, default_policy=policy)
    async with client(app) as c:
        first = await c.post("/orders", headers=key("k1"))
        replay = await c.post("/orders", headers=key("k1"))
    assert first.headers.get_list("set-cookie") == [
        "session=first-client; Path=/; SameSite=lax",
        "csrf=t-1; Path=/; SameSite=lax",
    ]
    expected = [] if hook is None else ["csrf=t-2"]
    assert replay.headers.get_list("set-cookie") == expected
    assert (replay.content, replay.headers["x-order"]) == (b"ok", "o-1")


async def test_a_replay_carries_no_timing_of_the_first_response(pg_store: Any) -> None:
    """docs/decisions.md, "Date and Server are the replay's own": a timing middleware inside
    (FastAPI's documented `X-Process-Time` one, `Server-Timing`) timed the first response; its
    headers were stored and every retry was told the first response's time. A replay carries
    none (one outside times each attempt, the replay included)."""

    async def timed(request: Request) -> Response:
        return Response(b"ok", 201, headers={"server-timing": "db;dur=53", "x-order": "o-1"})

    class Timing:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def timed_send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message["headers"], (b"x-process-time", b"0.120")]
                await send(message)

            await self.app(scope, receive, timed_send)

    app = one_route_app("/orders", timed, store=pg_store)
    app.user_middleware.append(Middleware(Timing))  # the innermost
    async with client(app) as c:
        first = await c.post("/orders", headers=key("k1"))
        replay = await c.post("/orders", headers=key("k1"))
    assert first.headers["x-process-time"] == "0.120"
    assert first.headers["server-timing"] == "db;dur=53"
    assert replay.headers["idempotent-replayed"] == "true"
    assert "x-process-time" not in replay.headers
    assert "server-timing" not in replay.headers
    assert (replay.status_code, replay.content, replay.headers["x-order"]) == (201, b"ok", "o-1")
