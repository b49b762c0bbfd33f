"""The request body reaches the app in the server's own message when it came in one: no message
of the middleware's own per request. A body that came in pieces, and a handler run again, get a
message made for them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.store.memory.sessions import _MemoryTransaction
from tests.apps import asgi_request
from tests.apps.clients import BearerBackend

pytestmark = pytest.mark.asyncio

BODY = b'{"amount": 5}'


class Conflict(Exception):
    """What the store below takes for a serialization failure of the handler's writes."""


class _ConflictingTransaction(_MemoryTransaction):
    def conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, Conflict)


class ConflictingStore(MemoryStore):
    def transaction(self, *, acquire_timeout: float) -> Any:
        return _ConflictingTransaction(self)


class Handler:
    """A raw ASGI endpoint: records every `receive()` result; conflicts on its first run if told
    to, after changing the message it got (as a careless app may)."""

    def __init__(self, conflict_first: bool = False) -> None:
        self.received: list[Message] = []
        self.conflict_first = conflict_first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        self.received.append(message)
        if self.conflict_first and len(self.received) == 1:
            message["body"] = b"changed by the first run"
            raise Conflict
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _app(handler: Handler, store: MemoryStore, policy: Policy | None = None) -> Starlette:
    return Starlette(
        routes=[Route("/things", handler, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=policy),
        ],
    )


async def _serve(
    app: Starlette, messages: list[Message], key: str, declared: bool = True
) -> list[Message]:
    size = sum(len(m.get("body", b"")) for m in messages)
    scope = asgi_request("/things", key, size)
    if not declared:  # (chunked: no Content-Length to refuse it by)
        scope["headers"] = [h for h in scope["headers"] if h[0] != b"content-length"]
    todo = list(messages)
    sent: list[Message] = []

    async def receive() -> Message:
        if todo:
            return todo.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def test_a_body_in_one_message_reaches_the_app_in_that_message() -> None:
    handler = Handler()
    server_message = {"type": "http.request", "body": BODY, "more_body": False}
    sent = await _serve(_app(handler, MemoryStore()), [server_message], "k1")
    assert sent[0]["status"] == 201
    assert handler.received[0] is server_message


async def test_a_body_in_pieces_reaches_the_app_whole_in_a_message_of_its_own() -> None:
    handler = Handler()
    pieces = [
        {"type": "http.request", "body": BODY[:5], "more_body": True},
        {"type": "http.request", "body": BODY[5:], "more_body": False},
    ]
    sent = await _serve(_app(handler, MemoryStore()), pieces, "k1")
    assert sent[0]["status"] == 201
    assert handler.received == [{"type": "http.request", "body": BODY, "more_body": False}]
    assert all(handler.received[0] is not piece for piece in pieces)


async def test_a_handler_run_again_gets_the_body_anew_whatever_its_first_run_did() -> None:
    handler = Handler(conflict_first=True)
    server_message = {"type": "http.request", "body": BODY, "more_body": False}
    sent = await _serve(_app(handler, ConflictingStore()), [server_message], "k1")
    assert sent[0]["status"] == 201
    first, second = handler.received
    assert first is server_message
    assert second is not server_message
    assert second == {"type": "http.request", "body": BODY, "more_body": False}


async def test_a_body_in_more_empty_pieces_than_the_bound_is_refused_before_any_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every loop is bounded: past the bound on a body's empty messages the request is refused
    (400), nothing is claimed and the handler never runs."""
    monkeypatch.setattr("idem_middleware.exchange._MAX_EMPTY_MESSAGES", 2)
    handler = Handler()
    store = MemoryStore()
    pieces = [{"type": "http.request", "body": b"", "more_body": True}] * 3
    pieces.append({"type": "http.request", "body": BODY, "more_body": False})
    sent = await _serve(_app(handler, store), pieces, "k1")
    assert sent[0]["status"] == 400
    assert b"too many empty pieces" in sent[1]["body"]
    assert handler.received == []
    assert len(store._rows) == 0
    # Within the bound, the same pieces make one body.
    monkeypatch.setattr("idem_middleware.exchange._MAX_EMPTY_MESSAGES", 3)
    sent = await _serve(_app(handler, store), pieces, "k2")
    assert sent[0]["status"] == 201
    assert handler.received == [{"type": "http.request", "body": BODY, "more_body": False}]


async def test_a_body_trickled_a_byte_a_message_is_read_whole_and_over_its_cap_is_a_413(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by probing: the bound counted every message, so a body a client trickled in more
    pieces than the bound (a byte per TCP segment) was refused `400` whatever its size, and one
    over its cap was that `400` instead of `413 body-too-large`. Pieces that bring bytes are
    bounded by the cap itself."""
    monkeypatch.setattr("idem_middleware.exchange._MAX_EMPTY_MESSAGES", 2)
    # (The bound on every message it had, were it back: it must not apply to bytes.)
    monkeypatch.setattr("idem_middleware.exchange._MAX_BODY_MESSAGES", 2, raising=False)
    handler = Handler()
    store = MemoryStore()
    trickled = [{"type": "http.request", "body": bytes([b]), "more_body": True} for b in BODY]
    trickled.append({"type": "http.request", "body": b"", "more_body": False})
    sent = await _serve(_app(handler, store), trickled, "k1")
    assert sent[0]["status"] == 201
    assert handler.received == [{"type": "http.request", "body": BODY, "more_body": False}]
    capped = _app(handler, store, Policy(max_body_bytes=len(BODY) - 1))
    sent = await _serve(capped, trickled, "k2", declared=False)
    assert sent[0]["status"] == 413
    assert len(handler.received) == 1


async def test_a_record_key_built_in_c_is_the_named_tuple() -> None:
    from idem_middleware.store.base import RecordKey, new_record_key

    key = new_record_key(("tenant", "POST /things", "k1"))
    assert type(key) is RecordKey
    assert key == RecordKey("tenant", "POST /things", "k1")
    assert (key.tenant, key.operation, key.key) == ("tenant", "POST /things", "k1")
    assert hash(key) == hash(RecordKey("tenant", "POST /things", "k1"))
