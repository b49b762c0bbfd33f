"""What the ASGI specification lets a server send, though common servers do not: a guarded
request reaches its handler whole, and its fingerprint covers what the handler reads.

- `headers` may be any iterable of pairs, a one-shot one too: the middleware reads them more
  than once (the key, the body's headers, the fingerprint), and a generator reached the app
  empty (no Content-Type; an `include_headers` header fingerprinted as absent, so another
  version of the request was replayed instead of refused);
- a message of a type the middleware does not know, before or within the body, is passed by,
  as Starlette's reader passes it by: taken for an empty body, the handler ran on nothing and
  the real body was never read (and a request with another body was replayed to).

Found by probing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Message

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from tests.apps import post_scope

pytestmark = pytest.mark.asyncio

BODY = b'{"amount": 5}'


def _app(runs: list[dict[str, Any]]) -> Starlette:
    async def credit(request: Request) -> JSONResponse:
        seen = {
            "body": await request.body(),
            "type": request.headers.get("content-type"),
            "version": request.headers.get("x-api-version"),
        }
        runs.append(seen)
        return JSONResponse({"run": len(runs), **seen, "body": seen["body"].decode()}, 201)

    policy = Policy(include_headers=("x-api-version",))
    return Starlette(
        routes=[Route("/credits", credit, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                default_policy=policy,
                tenant_resolver=lambda scope: "tenant-a",
            )
        ],
    )


def _headers(version: bytes, body: bytes = BODY) -> list[tuple[bytes, bytes]]:
    return [
        (b"host", b"test"),
        (b"idempotency-key", b"k1"),
        (b"content-type", b"application/json"),
        (b"x-api-version", version),
        (b"content-length", str(len(body)).encode()),
    ]


async def _call(
    app: Starlette, headers: Iterable[tuple[bytes, bytes]], messages: list[Message]
) -> tuple[int, dict[str, Any]]:
    scope = post_scope("/credits", [])
    scope["headers"] = headers
    pending = list(messages)
    sent: list[Message] = []

    async def receive() -> Message:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, orjson.loads(body)


def _whole(body: bytes = BODY) -> list[Message]:
    return [{"type": "http.request", "body": body, "more_body": False}]


Made = Callable[[list[tuple[bytes, bytes]]], Iterable[tuple[bytes, bytes]]]


@pytest.mark.parametrize(
    "made", [iter, tuple, lambda pairs: (pair for pair in pairs)], ids=["iter", "tuple", "gen"]
)
async def test_headers_of_any_iterable_reach_the_handler_and_the_fingerprint(made: Made) -> None:
    runs: list[dict[str, Any]] = []
    app = _app(runs)
    status, first = await _call(app, made(_headers(b"v1")), _whole())
    assert status == 201
    assert (first["type"], first["version"]) == ("application/json", "v1")
    status, other = await _call(app, made(_headers(b"v2")), _whole())
    assert status == 422, other  # another version of the request, under the same key
    status, again = await _call(app, made(_headers(b"v1")), _whole())
    assert (status, again) == (201, first)
    assert len(runs) == 1


@pytest.mark.parametrize("where", ["first", "between"])
async def test_a_message_of_an_unknown_type_is_passed_by(where: str) -> None:
    runs: list[dict[str, Any]] = []
    app = _app(runs)
    odd: Message = {"type": "http.unknown.extension"}
    if where == "first":
        messages = [odd, *_whole()]
    else:
        messages = [
            {"type": "http.request", "body": BODY[:5], "more_body": True},
            odd,
            {"type": "http.request", "body": BODY[5:], "more_body": False},
        ]
    status, first = await _call(app, _headers(b"v1"), messages)
    assert status == 201
    assert first["body"] == BODY.decode()
    other = b'{"amount": 500}'
    status, refused = await _call(app, _headers(b"v1", other), [odd, *_whole(other)])
    assert status == 422, refused
    assert [run["body"] for run in runs] == [BODY]
