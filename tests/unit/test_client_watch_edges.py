"""What a guarded request's client watch makes of the server's receive() after the body: only
an `http.disconnect` is the client leaving. A receive() that raised (the server's failure) or
that yields another message is not: a waiting duplicate goes on waiting and replays, and a
handler's incomplete response is not taken for one its client cut short. A client that does
leave ends the duplicate's wait, and the wait itself is cancelled with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from idem_middleware.client_watch import ClientWatch
from idem_middleware.errors import ClientGone
from idem_middleware.store.base import RecordKey, State
from tests.apps import BOUND, until
from tests.apps.clients import post_scope

pytestmark = pytest.mark.asyncio

Receive = Callable[[], Awaitable[dict[str, Any]]]


async def _post(app: Any, after_body: Receive) -> list[Any]:
    """The messages sent for one request; receive() after its body is `after_body`."""
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"b", "more_body": False}
        return await after_body()

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [(b"host", b"x"), (b"idempotency-key", b"k"), (b"content-type", b"text/plain")]
    await app(post_scope("/pay", headers), receive, send)
    return sent


async def _stays() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}  # pragma: no cover


async def _fails() -> dict[str, Any]:
    raise OSError("the server's receive() failed")


async def _talks() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


@pytest.mark.parametrize("after_body", [_fails, _talks], ids=["receive-raised", "no-disconnect"])
async def test_a_duplicate_whose_watch_reports_no_disconnect_waits_and_replays(
    after_body: Receive,
) -> None:
    release = asyncio.Event()
    runs = 0

    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        await release.wait()
        return Response(b"paid", status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    mw = IdempotencyMiddleware(
        app,
        store=MemoryStore(),
        default_policy=Policy(mode=Mode.LEASE, wait_seconds=30),
        tenant_resolver=lambda scope: "t",
    )
    original = asyncio.ensure_future(_post(mw, _stays))
    try:
        await until(lambda: runs == 1)
        duplicate = asyncio.ensure_future(_post(mw, after_body))
        await until(lambda: mw.waiters.count == 1 or duplicate.done())
        assert not duplicate.done()
        release.set()
        sent = await asyncio.wait_for(duplicate, BOUND)
    finally:
        release.set()
        await asyncio.wait_for(original, BOUND)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 201
    assert (b"idempotent-replayed", b"true") in start["headers"]
    assert runs == 1


async def test_an_incomplete_response_after_a_failed_receive_is_unknown_not_cut_short() -> None:
    """The app asked for the client's disconnect (receive() after the body), the server's
    receive() raised, and the app returned mid-response: the client did not leave, so its
    outcome is `unknown` (not its status recorded with the body omitted)."""

    class Pay:  # (a raw ASGI endpoint)
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await receive()  # the body
            await send({"type": "http.response.start", "status": 201, "headers": []})
            with contextlib.suppress(OSError):
                await receive()  # (the server's receive() fails)
            # returned without the body: incomplete

    store = MemoryStore()
    mw = IdempotencyMiddleware(
        Starlette(routes=[Route("/pay", Pay(), methods=["POST"])]),
        store=store,
        default_policy=Policy(mode=Mode.LEASE),
        tenant_resolver=lambda scope: "t",
    )
    with pytest.raises(RuntimeError, match="without a complete response"):
        await asyncio.wait_for(_post(mw, _fails), BOUND)
    record = await store.get(RecordKey("t", "POST /pay", "k"))
    assert record is not None
    assert record.state is State.UNKNOWN


class _Watched(ClientWatch):
    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.client_watch = None
        self.disconnected = None


async def test_a_client_leaving_cancels_the_wait_it_cut_short() -> None:
    gone, waiting, ended = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def wait() -> None:
        try:
            waiting.set()
            await asyncio.Event().wait()
        finally:
            ended.set()

    watched = _Watched(receive)
    present = asyncio.ensure_future(watched.wait_present(wait()))
    await asyncio.wait_for(waiting.wait(), BOUND)
    gone.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(present, BOUND)
    await asyncio.wait_for(ended.wait(), BOUND)  # the wait was cancelled, not left running
    assert watched.client_left()
