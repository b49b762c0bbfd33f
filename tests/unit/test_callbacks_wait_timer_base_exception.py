"""A lease-mode duplicate's waiting place (`max_waiters`) is given back however its wait ends,
even when an observer's `wait` timer raises a BaseException as it starts (an observer may not
catch KeyboardInterrupt or SystemExit, and the fan-out lets them through). The place was taken
before the timer started and its giving back registered after: the exception skipped the
registration, and the process lost one waiting place for good (with `max_waiters=1`, every
later duplicate was answered `409` "too many requests are waiting" at once)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from idem_middleware.observe import Event
from tests.apps.clients import BearerBackend, post_scope


class BreaksTheWait:
    """Raises `exc` once, as the timer of a duplicate's wait starts."""

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc: type[BaseException] | None = exc

    def event(self, event: Event, attributes: Any) -> None:
        pass

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Any) -> Iterator[None]:
        if name == "wait" and self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc()
        yield


async def _post(app: Any, key: bytes) -> int | str | None:
    headers = [
        (b"host", b"test"),
        (b"authorization", b"Bearer demo-a"),
        (b"content-type", b"application/json"),
        (b"idempotency-key", key),
    ]
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    try:
        await app(post_scope("/pay", headers), receive, send)
    except (KeyboardInterrupt, SystemExit) as exc:
        return type(exc).__name__
    return status[0] if status else None


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
async def test_a_wait_timer_raising_a_base_exception_gives_the_waiting_place_back(
    exc: type[BaseException],
) -> None:
    async def pay(request: Request) -> Response:
        await request.body()
        await asyncio.sleep(0.1)
        return JSONResponse({"paid": True}, status_code=201)

    inner = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    mw = IdempotencyMiddleware(
        inner,
        store=MemoryStore(),
        default_policy=Policy(mode=Mode.LEASE, lease_seconds=30, wait_seconds=2),
        observers=[BreaksTheWait(exc)],
        max_waiters=1,
    )
    app = AuthenticationMiddleware(mw, backend=BearerBackend())

    async def duplicated(key: bytes) -> list[int | str | None]:
        first = asyncio.create_task(_post(app, key))
        await asyncio.sleep(0.02)  # (the first holds the key: the second waits for it)
        second = await _post(app, key)
        return [await first, second]

    async with asyncio.timeout(10):
        assert await duplicated(b"k-1") == [201, exc.__name__]
        assert mw.waiters.count == 0, "the waiting place was never given back"
        # The one waiting place is there for the next key's duplicate: it waits, and is replayed.
        assert await duplicated(b"k-2") == [201, 201]
