"""Behaviours no test pinned before (a run of hand-made mutations of the request path survived
each of them): the first of two Content-Types decides the fingerprint, as it decides what the
app reads; a JSON body under a charset other than UTF-8 is refused through the middleware, not
only by `canonical_body`; a handler that returns mid-response records nothing; lease mode's 409
and 429 carry Retry-After; the in-memory store refuses a token of another operation or request,
or at its expiry, as PostgreSQL does; the downstream key's derivation is pinned across
releases; a replay carries one `Idempotent-Replayed`. MemoryStore only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, derive_downstream_key
from idem_middleware.fingerprint import compute_fingerprint
from idem_middleware.policy import Mode
from idem_middleware.tokens import TokenIssuer
from tests.apps import (
    BOUND,
    AsServer,
    BearerBackend,
    client,
    one_route_app,
    post_scope,
    wait_for_waiters,
)


class Calls:
    def __init__(self) -> None:
        self.n = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()


def app_with(handler_calls: Calls, **options: Any) -> Any:
    async def handler(request: Request) -> Response:
        handler_calls.n += 1
        body = await request.body()
        handler_calls.entered.set()
        if handler_calls.gate is not None:
            await handler_calls.gate.wait()
        return JSONResponse({"call": handler_calls.n, "len": len(body)}, status_code=201)

    return one_route_app("/op", handler, **options)


async def drive(app: Any, headers: list[tuple[bytes, bytes]], body: bytes) -> list[dict[str, Any]]:
    """One raw ASGI request (headers exactly as given, repeats kept); the messages sent."""
    server = AsServer(body)
    await asyncio.wait_for(app(post_scope("/op", headers), server.receive, server.send), BOUND)
    return server.sent


# -- exchange.py:340-341: the FIRST Content-Type decides the fingerprint ----------


async def test_repeated_content_type_the_first_decides_the_fingerprint() -> None:
    calls = Calls()
    app = app_with(calls, store=MemoryStore())
    base = [
        (b"host", b"test"),
        (b"authorization", b"Bearer demo-a"),
        (b"idempotency-key", b"k-ct"),
        (b"content-type", b"text/plain"),  # what Starlette's request.headers[...] returns
        (b"content-type", b"application/json"),
    ]
    first = await drive(app, base, b'{"a":1}')
    second = await drive(app, base, b'{"a": 1}')  # other bytes: another text/plain request
    assert first[0]["status"] == 201
    assert second[0]["status"] == 422, second[0]  # key reused for a different request


# -- fingerprint.py:158: a non-UTF-8 JSON charset is refused --------------


@pytest.mark.parametrize(
    "content_type",
    [b'application/json; charset="utf-16"', b"application/json; charset=iso-8859-1"],
)
async def test_a_json_body_under_a_non_utf8_charset_is_refused_over_http(
    content_type: bytes,
) -> None:
    calls = Calls()
    app = app_with(calls, store=MemoryStore())
    body = '{"a":"\u00e9"}'.encode() if b"8859" in content_type else b'{"a":1}'
    async with client(app) as c:
        r = await c.post(
            "/op",
            content=body,
            headers={"idempotency-key": "k-cs", "content-type": content_type.decode()},
        )
    assert r.status_code == 400, r.text
    assert calls.n == 0


# -- transactional.py:230: an unfinished response is never recorded ------------


async def test_a_handler_that_returns_mid_response_is_not_recorded() -> None:
    runs = 0

    async def raw_app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        runs += 1
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        # returns without the last body message

    class Raw:
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await raw_app(scope, receive, send)

    app = Starlette(
        routes=[Route("/op", Raw(), methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=Policy()),
        ],
    )
    async with client(app) as c:
        first = await c.post("/op", json={"a": 1}, headers={"idempotency-key": "k-inc"})
        second = await c.post("/op", json={"a": 1}, headers={"idempotency-key": "k-inc"})
    assert second.headers.get("idempotent-replayed") is None, (
        first.status_code,
        second.status_code,
        second.content,
    )
    assert runs == 2  # nothing recorded: the retry runs again


# -- lease.py:113 and :307 (l-waiters-ra, l-busy-ra): lease-mode 409/429 carry Retry-After ----


async def test_lease_mode_waiters_full_409_has_retry_after() -> None:
    calls = Calls()
    calls.gate = asyncio.Event()
    app = app_with(
        calls,
        store=MemoryStore(),
        default_policy=Policy(mode=Mode.LEASE, wait_seconds=60),
        max_waiters=1,
    )
    async with client(app) as c:
        first = asyncio.ensure_future(c.post("/op", json={}, headers={"idempotency-key": "k1"}))
        await asyncio.wait_for(calls.entered.wait(), BOUND)
        waiting = asyncio.ensure_future(c.post("/op", json={}, headers={"idempotency-key": "k1"}))
        await wait_for_waiters(app, 1)
        third = await asyncio.wait_for(
            c.post("/op", json={}, headers={"idempotency-key": "k1"}), BOUND
        )
        calls.gate.set()
        await asyncio.wait_for(asyncio.gather(first, waiting), BOUND)
    assert third.status_code == 409, third.text
    assert third.headers.get("retry-after") == "1"


# -- store/memory/tables.py:380-386 (tb-token-*): the memory twin checks tokens as PG does ------

SECRET = b"s" * 32
OP = "POST /op"


async def test_memory_store_refuses_a_token_for_another_operation_or_request_or_expired() -> None:
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    issuer = TokenIssuer(store, secret=SECRET, ttl_seconds=60)
    calls = Calls()
    app = app_with(calls, store=store, default_policy=Policy(require_token=True))
    other_op = (await issuer.issue("tenant-a", "POST /elsewhere", intent_id="i-0")).token
    digest = compute_fingerprint(
        operation=OP,
        path_params={},
        query_string=b"",
        headers=[],
        include_headers=(),
        content_type=b"application/json",
        body=b'{"amount":5}',
    )
    bound = (await issuer.issue("tenant-a", OP, intent_id="i-1", request_digest=digest)).token
    expiring = await issuer.issue("tenant-a", OP, intent_id="i-2")
    async with client(app) as c:
        h = {"content-type": "application/json"}
        r_op = await c.post(
            "/op", content=b'{"amount":5}', headers={**h, "idempotency-key": other_op}
        )
        r_body = await c.post(
            "/op", content=b'{"amount":6}', headers={**h, "idempotency-key": bound}
        )
        assert calls.n == 0
        # (The token bound to the request is taken with that request's body.)
        r_ok = await c.post("/op", content=b'{"amount":5}', headers={**h, "idempotency-key": bound})
        now[0] = expiring.expires_at.timestamp()  # (at its expiry: expired, as PostgreSQL says)
        r_exp = await c.post(
            "/op", content=b'{"amount":5}', headers={**h, "idempotency-key": expiring.token}
        )
    assert (r_op.status_code, r_body.status_code, r_exp.status_code) == (400, 400, 400), (
        r_op.text,
        r_body.text,
        r_exp.text,
    )
    assert r_ok.status_code == 201, r_ok.text
    assert calls.n == 1


# -- context.py:48-51: the downstream key is pinned across releases -----------


def test_the_downstream_key_derivation_is_pinned() -> None:
    assert derive_downstream_key("tenant-a", "POST /payouts", "k1", 7) == (
        "043b22f2c55c32076f331643b267196f6d18cb3e57e405a6ce0937c81f6df5d6"
    )
    assert derive_downstream_key("tenant-a", "POST /payouts", "k1") == (
        "fb183d1d8ca05d176d1d5c447b56817d272eb4ad8c0c34989b7972f51e97b47c"
    )


# -- responses.py:70: a handler's own Idempotent-Replayed is never stored ---


async def test_a_replay_has_one_idempotent_replayed_header() -> None:
    async def handler(request: Request) -> Response:
        return JSONResponse({}, status_code=201, headers={"idempotent-replayed": "false"})

    app = one_route_app("/op", handler, store=MemoryStore())
    async with client(app) as c:
        await c.post("/op", json={}, headers={"idempotency-key": "k-r"})
        replay = await c.post("/op", json={}, headers={"idempotency-key": "k-r"})
    assert replay.headers.get_list("idempotent-replayed") == ["true"]


@pytest.mark.parametrize(
    ("mode", "second"),
    [
        (Mode.TRANSACTIONAL, "another key"),
        (Mode.LEASE, "another key"),
    ],
)
async def test_with_the_tenants_slots_taken_a_request_is_told_429(mode: Mode, second: str) -> None:
    """With the tenant's slots all taken, another request is answered 429 + Retry-After, in
    either mode. (A duplicate of the request in flight in this process waits without a slot, in
    either mode: test_duplicates_held_here.py, test_slotdup_held_here.py.) The original is not
    disturbed."""
    calls = Calls()
    calls.gate = asyncio.Event()
    policy = Policy(mode=mode, wait_seconds=2)
    app = app_with(calls, store=MemoryStore(), default_policy=policy, max_tenant_connections=1)
    key = "k1" if second == "a duplicate" else "k2"
    async with client(app) as c:
        first = asyncio.ensure_future(c.post("/op", json={}, headers={"idempotency-key": "k1"}))
        await asyncio.wait_for(calls.entered.wait(), BOUND)
        refused = await asyncio.wait_for(
            c.post("/op", json={}, headers={"idempotency-key": key}), BOUND
        )
        calls.gate.set()
        original = await asyncio.wait_for(first, BOUND)
    assert original.status_code == 201
    assert refused.status_code == 429, refused.text
    assert refused.headers.get("retry-after") == "1"
    assert calls.n == 1
