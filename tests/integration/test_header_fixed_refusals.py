"""A 4xx whose fix is in the request's headers, framing or connection is never stored.

Found by probing: `412 Precondition Failed` was stored as `failed_final`. A client's PATCH with
a stale `If-Match` got its 412; it read the resource again and sent the same change under the
same key with the current `If-Match`, and was replayed the 412 (`Idempotent-Replayed: true`)
for the record's whole retention: the fingerprint covers the body, not `If-Match`, so the
corrected request looked like the refused one, and a precondition that now holds was answered
as failed. The same held for every refusal that RFC 9110 says performed nothing and whose
remedy the fingerprint cannot see:

- 411 Length Required: the same body again, with a Content-Length;
- 412 Precondition Failed and 428 Precondition Required: a (new) `If-Match`;
- 417 Expectation Failed: "SHOULD repeat that request without a 100-continue expectation"
  (RFC 9110 10.1.1), the very request again;
- 421 Misdirected Request: the very request again, over another connection (RFC 9110 15.5.20);
- 431 Request Header Fields Too Large: the same request with smaller headers.

Nothing happened for any of them, so the key is released, as for 409 or 422, and the fixed
retry runs. Driven in both modes on PostgreSQL, the replay (or not) read from the client.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy
from tests.apps import BearerBackend, count, post_scope

pytestmark = pytest.mark.asyncio

MODES = pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])


async def _patch(request: Request) -> Response:
    """A document at version `state.version`, changed by a PATCH whose `If-Match` names it; the
    refusals a server makes before acting, each on the header that causes it."""
    state = request.app.state
    body = await request.body()
    if request.headers.get("expect", "").lower() == "100-continue":
        return Response(status_code=417)  # (an app that takes no expectations)
    if request.headers.get("x-coalesced") == "yes":
        return Response(status_code=421)  # (the connection reached a server not for it)
    if len(request.headers.get("x-big", "")) > 100:
        return Response(status_code=431)
    if "content-length" not in request.headers:
        return Response(status_code=411)
    match = request.headers.get("if-match")
    if match is None:
        return Response(status_code=428)
    if match != f'"v{state.version}"':
        return Response(status_code=412, headers={"etag": f'"v{state.version}"'})
    state.version += 1
    state.applied.append(body)
    return JSONResponse({"version": state.version}, headers={"etag": f'"v{state.version}"'})


def _app(store: Any, mode: Mode) -> Starlette:
    policy = Policy(mode=mode, lease_seconds=5.0, wait_seconds=0.3)
    app = Starlette(
        routes=[Route("/docs/{doc}", _patch, methods=["PATCH"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=policy),
        ],
    )
    app.state.version, app.state.applied = 1, []
    return app


def _client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://test",
        headers={"authorization": "Bearer demo-a"},
    )


BODY = b'{"title": "new"}'
CURRENT = {"if-match": '"v1"'}
#: A refused request's headers, by the status it gets; each refused request's fix is CURRENT.
REFUSED = {
    412: {"if-match": '"v0"'},
    428: {},
    417: {**CURRENT, "expect": "100-continue"},
    421: {**CURRENT, "x-coalesced": "yes"},
    431: {**CURRENT, "x-big": "b" * 200},
}


async def _send(c: httpx.AsyncClient, key: str, headers: dict[str, str]) -> httpx.Response:
    return await c.patch(
        "/docs/d1",
        content=BODY,
        headers={"idempotency-key": key, "content-type": "application/json", **headers},
    )


@MODES
@pytest.mark.parametrize("status", sorted(REFUSED))
async def test_a_retry_with_the_fix_runs_instead_of_getting_the_refusal_replayed(
    pg_store: Any, pool: Any, mode: Mode, status: int
) -> None:
    app = _app(pg_store, mode)
    async with _client(app) as c:
        refused = await _send(c, "k", REFUSED[status])
        fixed = await _send(c, "k", CURRENT)
        again = await _send(c, "k", CURRENT)
    assert refused.status_code == status
    assert "idempotent-replayed" not in refused.headers
    assert fixed.status_code == 200, (fixed.status_code, fixed.headers)
    assert "idempotent-replayed" not in fixed.headers
    assert fixed.json() == {"version": 2}
    assert (again.status_code, again.headers["idempotent-replayed"]) == (200, "true")
    assert again.content == fixed.content
    assert app.state.applied == [BODY]
    assert await count(pool, "idem_requests") == 1


async def _unframed(app: Starlette, key: str) -> tuple[int, dict[bytes, bytes]]:
    """A PATCH whose body comes in pieces with no Content-Length (a chunked request)."""
    sent: list[dict[str, Any]] = []
    messages = [
        {"type": "http.request", "body": BODY[:5], "more_body": True},
        {"type": "http.request", "body": BODY[5:], "more_body": False},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [
        (b"host", b"test"),
        (b"authorization", b"Bearer demo-a"),
        (b"idempotency-key", key.encode()),
        (b"content-type", b"application/json"),
        (b"if-match", b'"v1"'),
        (b"transfer-encoding", b"chunked"),
    ]
    scope = {**post_scope("/docs/d1", headers), "method": "PATCH"}
    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"])


@MODES
async def test_a_length_required_refusal_lets_the_framed_retry_run(
    pg_store: Any, pool: Any, mode: Mode
) -> None:
    """411: the same body again with a Content-Length is the same fingerprint; it runs."""
    app = _app(pg_store, mode)
    status, _ = await _unframed(app, "k")
    assert status == 411
    async with _client(app) as c:
        fixed = await _send(c, "k", CURRENT)
    assert (fixed.status_code, "idempotent-replayed" in fixed.headers) == (200, False)
    assert app.state.applied == [BODY]
    assert await count(pool, "idem_requests") == 1


@MODES
async def test_a_final_refusal_is_still_stored_and_replayed(
    pg_store: Any, pool: Any, mode: Mode
) -> None:
    """The other 4xx stay final (402 here, as before): replayed, not run again."""

    async def pay(request: Request) -> Response:
        await request.body()
        request.app.state.applied.append(b"")
        return JSONResponse({"error": "card declined"}, status_code=402)

    app = _app(pg_store, mode)
    app.router.routes.append(Route("/pay", pay, methods=["POST"]))
    async with _client(app) as c:
        first = await c.post("/pay", content=b"{}", headers={"idempotency-key": "p"})
        second = await c.post("/pay", content=b"{}", headers={"idempotency-key": "p"})
    assert (first.status_code, second.status_code) == (402, 402)
    assert second.headers["idempotent-replayed"] == "true"
    assert len(app.state.applied) == 1
