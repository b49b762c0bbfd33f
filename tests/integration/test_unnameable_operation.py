"""An operation named by the request itself: a route whose endpoint takes any method (the
method is the client's), or a sub-app with its own middleware behind a mount the middleware
cannot see through (the mount's path, parameters filled in, is the client's). Such a name of
more than 1,024 bytes reached PostgreSQL's primary-key index, which refuses entries over 2,704
bytes: the driver's error escaped as a bare 500 (with the fast path, only after the handler had
run, for every attempt). Such a name is refused now, `400 operation-invalid`, before the body is
read or anything is claimed."""

from __future__ import annotations

import random
import string
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, PostgresStore, idempotent
from idem_middleware.errors import TextRefused
from idem_middleware.store.base import RecordKey
from tests.apps.clients import BearerBackend, client

#: Random text: a repeated character compresses below the index's limit, and passes.
_LONG = "".join(random.Random(7).choices(string.ascii_letters + string.digits, k=3000))


def _stack(store: Any) -> list[Middleware]:
    return [
        Middleware(AuthenticationMiddleware, backend=BearerBackend()),
        Middleware(IdempotencyMiddleware, store=store),
    ]


def _any_method_app(store: Any, runs: list[str]) -> Starlette:
    class Hook:  # (an ASGI app as the endpoint: every method reaches it)
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            runs.append(scope["method"])
            await JSONResponse({"ok": True}, 201)(scope, receive, send)

    return Starlette(routes=[Route("/hook", idempotent()(Hook()))], middleware=_stack(store))


def _hidden_mount_app(store: Any, runs: list[str]) -> Starlette:
    async def pay(request: Request) -> Response:
        runs.append(request.url.path)
        return JSONResponse({"paid": True}, 201)

    sub = Starlette(routes=[Route("/pay", pay, methods=["POST"])], middleware=_stack(store))

    async def hidden(scope: Scope, receive: Receive, send: Send) -> None:
        await sub(scope, receive, send)  # (a wrapper the outer router cannot see through)

    return Starlette(routes=[Mount("/t/{tid}", app=hidden)])


@pytest.mark.parametrize(
    ("build", "method", "path"),
    [
        (_any_method_app, "X" + _LONG.upper(), "/hook"),
        (_hidden_mount_app, "POST", f"/t/{_LONG}/pay"),
    ],
    ids=["long-method", "long-mount-path"],
)
async def test_an_operation_no_record_can_hold_is_refused_before_the_claim(
    store: Any, build: Any, method: str, path: str
) -> None:
    runs: list[str] = []
    app = build(store, runs)
    async with client(app) as c:
        for attempt in range(2):
            answer = await c.request(method, path, headers={"idempotency-key": "k1"}, content=b"{}")
            assert answer.status_code == 400, (attempt, answer.text[:300])
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["type"].endswith(":operation-invalid")
        # The same app still serves a request it can name.
        fine = await c.request(
            "POST" if method == "POST" else "PURGE",
            path.replace(_LONG, "abc"),
            headers={"idempotency-key": "k1"},
            content=b"{}",
        )
    assert fine.status_code == 201, fine.text
    assert len(runs) == 1  # only the request it could name ran


async def test_a_key_too_long_for_the_index_is_the_stores_refusal_not_the_drivers(
    pool: Any,
) -> None:
    """The store's own callers (a job, a test) reach the claim without the middleware's check:
    PostgreSQL's refusal is `TextRefused` (500 server-misconfigured), not asyncpg's error."""
    key = RecordKey("tenant-a", "POST " + _LONG, "k1")
    store = PostgresStore(pool=pool, fast_path=False, listen=False)  # (the fast path defers it)
    with pytest.raises(TextRefused):
        async with store.transaction(acquire_timeout=5) as tx:
            await tx.claim(key, b"f" * 32, retention_seconds=60, wait_seconds=1)
