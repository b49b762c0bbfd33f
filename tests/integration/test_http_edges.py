"""HTTP/1.1 edges of guarded requests behind real uvicorn servers (h11 and httptools) on
127.0.0.1, spoken to over raw sockets, counted in the database: `Expect: 100-continue`, CORS
preflights and HEAD, and responses whose status allows no content.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, Policy
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    BearerBackend,
    Step,
    build_app,
    build_lease_app,
    count,
    downstream_rows,
    records,
    reset_downstream,
)
from tests.apps.servers import connection, parse_head, read_response, uvicorn_serving

pytestmark = pytest.mark.asyncio

PATH = b"/accounts/a1/credits"
BODY = b'{"amount": 5}'
CAP = 64  # the body cap of these tests' policy
SERVERS = pytest.mark.parametrize("http", ["h11", "httptools"])


def head(
    key: bytes | None,
    body: bytes,
    *,
    token: bytes = b"demo-a",
    length: int | None = None,
    path: bytes = PATH,
) -> bytes:
    """A guarded POST's head, asking `Expect: 100-continue`."""
    lines = [b"POST " + path + b" HTTP/1.1", b"host: test", b"authorization: Bearer " + token]
    if key is not None:
        lines.append(b"idempotency-key: " + key)
    lines += [
        b"content-type: application/json",
        b"content-length: %d" % (len(body) if length is None else length),
        b"expect: 100-continue",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def ask(
    port: int, key: bytes | None, body: bytes = BODY, **options: Any
) -> tuple[bool, int, dict[bytes, bytes], bytes]:
    """Send the head alone and the body only if the server says `100 Continue` (as curl and
    .NET do); whether it did, and the final response."""
    async with connection(port) as (reader, writer):
        writer.write(head(key, body, **options))
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
        continued = first.startswith(b"HTTP/1.1 100")
        if not continued:
            status, headers = parse_head(first)
            length = int(headers.get(b"content-length", b"0"))
            return False, status, headers, await asyncio.wait_for(reader.readexactly(length), BOUND)
        writer.write(body)
        return True, *(await asyncio.wait_for(read_response(reader), BOUND))


def problem_kind(headers: dict[bytes, bytes], body: bytes) -> str:
    assert headers[b"content-type"] == b"application/problem+json"
    return str(json.loads(body)["type"]).rsplit(":", 1)[1]


class Guarded:
    """The guarded route in `mode`: transactional (`build_app`'s credit) or lease
    (`build_lease_app`'s payout), both with this module's body cap and a duplicate waiting
    50 ms for the holder."""

    def __init__(self, mode: str, pg_store: Any, pool: Any) -> None:
        self.mode, self.pool = mode, pool
        if mode == "lease":
            policy = LEASE_POLICY.replace(max_body_bytes=CAP, wait_seconds=0.05)
            self.app = build_lease_app(pg_store, pool, policy)
            self.path, self.body = PAYOUTS.encode(), b'{"account": "a1", "amount": 5}'
        else:
            self.app = build_app(
                pg_store, default_policy=Policy(max_body_bytes=CAP, wait_seconds=0.05)
            )
            self.path, self.body = PATH, BODY
        self.probe = self.app.state.probe

    def hold_next(self, gate: asyncio.Event) -> None:
        """The next execution stops inside its claim until `gate` is set; `probe.entered` is
        cleared, so that it is set again by that execution and by no earlier one."""
        self.probe.entered.clear()
        if self.mode == "lease":
            self.probe.steps = [Step(gate=gate)]
        else:
            self.probe.gate = gate

    async def effects(self) -> int:
        if self.mode == "lease":
            return await downstream_rows(self.pool)
        return await count(self.pool, "test_ledger")


@SERVERS
@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_expect_100_continue_asks_for_the_body_only_when_the_answer_needs_it(
    pg_store: Any, pool: Any, http: str, mode: str
) -> None:
    """What is refused on the head alone (no key, a bad key, no caller, a declared length over
    the cap) is answered without a `100`, so the client never uploads a body that would be
    thrown away. Everything else needs the body: a fresh request runs on it, and a duplicate's
    fingerprint is taken from it, so the replay, the mismatch and the in-flight answer come
    after the `100`, each as they do without `Expect`.

    The in-flight duplicate is sent only once the held request is inside its claim: the probe's
    `entered` is cleared first (the fresh request had set it), or the duplicate could race the
    held request to the claim, win it, and be the one held (seen under CPU load)."""
    if mode == "lease":
        await reset_downstream(pool)
    guarded = Guarded(mode, pg_store, pool)
    path, body = guarded.path, guarded.body
    async with uvicorn_serving(guarded.app, http) as port:
        refused = {
            "missing-key": await ask(port, None, body, path=path),
            "invalid-key": await ask(port, b'"unterminated', body, path=path),
            "unauthenticated": await ask(port, b"k", body, token=b"nobody", path=path),
            "body-too-large": await ask(port, b"k", b"x" * (CAP + 1), path=path),
        }
        for kind, (continued, status, headers, answer) in refused.items():
            assert (continued, problem_kind(headers, answer)) == (False, kind), (kind, status)
        assert await count(pool, "idem_requests") == 0

        fresh = await ask(port, b"k", body, path=path)
        replay = await ask(port, b"k", body, path=path)
        mismatch = await ask(port, b"k", body.replace(b": 5", b": 6"), path=path)
        assert (fresh[0], fresh[1]) == (True, 201)
        assert (replay[0], replay[1], replay[3]) == (True, 201, fresh[3])
        assert replay[2][b"idempotent-replayed"] == b"true"
        assert (mismatch[0], problem_kind(mismatch[2], mismatch[3])) == (True, "key-reused")

        gate = asyncio.Event()
        guarded.hold_next(gate)
        original = asyncio.ensure_future(ask(port, b"held", body, path=path))
        try:
            await asyncio.wait_for(guarded.probe.entered.wait(), BOUND)
            in_flight = await ask(port, b"held", body, path=path)
            assert (in_flight[0], in_flight[1]) == (True, 409)
            assert problem_kind(in_flight[2], in_flight[3]) == "request-in-flight"
        finally:
            gate.set()
            done, _ = await asyncio.wait({original}, timeout=BOUND)
        assert original in done, "the held request did not finish"
        assert original.result()[:2] == (True, 201)

    assert guarded.probe.calls == await guarded.effects() == 2
    assert sorted(r["idem_key"] for r in await records(pool)) == ["held", "k"]


async def _credit(request: Request) -> Response:
    await request.body()
    request.app.state.calls += 1
    return Response(b"{}", status_code=201, media_type="application/json")


async def test_cors_preflights_and_head_are_never_guarded(pg_store: Any, pool: Any) -> None:
    """CORSMiddleware outside the middleware answers a browser's preflight of a guarded POST
    (which carries no key and no credentials) itself; without it, OPTIONS and HEAD reach the
    app as they are: neither claims anything, nor is refused for a missing key."""
    routes = [
        Route("/pay", _credit, methods=["POST"]),
        Route("/pay-or-read", _credit, methods=["GET", "POST"]),
    ]
    guarded = [
        Middleware(AuthenticationMiddleware, backend=BearerBackend()),
        Middleware(IdempotencyMiddleware, store=pg_store),
    ]
    cors = Middleware(
        CORSMiddleware,
        allow_origins=["https://a.example"],
        allow_methods=["POST"],
        allow_headers=["idempotency-key", "content-type", "authorization"],
    )
    preflight = {
        "origin": "https://a.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "idempotency-key, content-type, authorization",
    }
    for middleware in ([cors, *guarded], guarded):
        app = Starlette(routes=routes, middleware=middleware)
        app.state.calls = 0
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            answer = await client.options("/pay", headers=preflight)
            head = await client.head("/pay-or-read")
        if middleware[0] is cors:
            assert answer.status_code == 200
            assert answer.headers["access-control-allow-origin"] == "https://a.example"
        else:
            assert answer.status_code == 405  # the app's own answer: /pay has no OPTIONS
        assert head.status_code == 201
        assert app.state.calls == 1  # the HEAD, unguarded
    assert await count(pool, "idem_requests") == 0


class _Recorded:
    """The app, with what it raised kept here instead of reaching the server (whose answer
    to it would be to close the connection)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.errors: list[BaseException] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            self.errors.append(exc)


@SERVERS
@pytest.mark.parametrize("status", [204, 304])
async def test_a_replay_of_a_response_without_content_sends_none(
    pg_store: Any, pool: Any, http: str, status: int
) -> None:
    """Found by probing: a handler's `Response(b"done", status_code=204)` was stored with its
    body. The server sends a 204 or 304 without content whatever the app gives it, so the first
    client got none; but every replay sent the body, uvicorn raised on it (h11: "Too much data
    for declared Content-Length", httptools: "Response content longer than Content-Length")
    and closed the connection, losing the client's next request on it."""

    async def done(request: Request) -> Response:
        await request.body()
        request.app.state.calls += 1
        return Response(b"done", status_code=status, headers={"x-done": "yes"})

    inner = Starlette(
        routes=[Route("/done", done, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=pg_store),
        ],
    )
    inner.state.calls = 0
    app = _Recorded(inner)
    post = (
        b"POST /done HTTP/1.1\r\nhost: test\r\nauthorization: Bearer demo-a\r\n"
        b"idempotency-key: k\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    )
    async with uvicorn_serving(app, http) as port:
        async with connection(port) as (reader, writer):
            writer.write(post)
            first_status, _ = parse_head(
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
            )
        assert first_status == status
        app.errors.clear()  # (the handler's own body, refused by the server: the app's to fix)

        # The replay, then another request on the same connection.
        async with connection(port) as (reader, writer):
            writer.write(post)
            replay = await asyncio.wait_for(read_response(reader), BOUND)
            writer.write(b"GET /missing HTTP/1.1\r\nhost: test\r\n\r\n")
            after = await asyncio.wait_for(read_response(reader), BOUND)
    assert app.errors == []
    assert replay[0] == status
    assert (replay[1][b"idempotent-replayed"], replay[1][b"x-done"]) == (b"true", b"yes")
    assert b"content-length" not in replay[1]
    assert after[0] == 404
    assert inner.state.calls == 1
    [record] = await records(pool)
    assert (record["state"], record["response_status"]) == ("succeeded", status)


def chunked(key: bytes, pieces: list[bytes], *, last: bool = True) -> bytes:
    """A guarded POST whose body is `pieces` as chunks, ended (or not) by the last chunk."""
    head = (
        b"POST " + PATH + b" HTTP/1.1\r\nhost: test\r\nauthorization: Bearer demo-a\r\n"
        b"idempotency-key: " + key + b"\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return head + body + (b"0\r\n\r\n" if last else b"")


@SERVERS
async def test_chunked_bodies_over_the_cap_or_left_unfinished_claim_nothing(
    pg_store: Any, pool: Any, http: str
) -> None:
    """A chunked body declares no length: one over the cap, in one-byte chunks, is refused
    with `413` once the cap is passed; one whose client leaves before its last chunk claims
    nothing. Each key's retry, whole, runs once."""
    app = build_app(pg_store, default_policy=Policy(max_body_bytes=CAP))
    over = b'{"amount": 5, "pad": "' + b"p" * CAP + b'"}'
    async with uvicorn_serving(app, http) as port:
        async with connection(port) as (reader, writer):
            writer.write(chunked(b"over", [bytes([byte]) for byte in over]))
            status, headers, body = await asyncio.wait_for(read_response(reader), BOUND)
        assert (status, problem_kind(headers, body)) == (413, "body-too-large")

        async with connection(port) as (reader, writer):
            writer.write(chunked(b"left", [BODY[:4], BODY[4:8]], last=False))
            await writer.drain()
        assert await count(pool, "idem_requests") == 0

        for key in (b"over", b"left"):
            async with connection(port) as (reader, writer):
                writer.write(chunked(key, [BODY[:4], BODY[4:]]))
                assert (await asyncio.wait_for(read_response(reader), BOUND))[0] == 201

    assert app.state.probe.calls == await count(pool, "test_ledger") == 2
    assert sorted(r["idem_key"] for r in await records(pool)) == ["left", "over"]
