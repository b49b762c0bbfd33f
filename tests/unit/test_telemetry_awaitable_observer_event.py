"""An observer's `event` that hands back an awaitable is never awaited: its events were lost
without a word from the library (only Python's "coroutine ... was never awaited" warning, with
no observer named). The construction check caught an `async def event` only: not an object with
an `async def __call__` given as `event`, nor a plain function that returns a coroutine."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.observe import Event
from tests.apps import client

SENT: list[Event] = []


class AsyncCallable:
    async def __call__(self, event: Event, attributes: Mapping[str, Any]) -> None:
        SENT.append(event)


class Timed:
    @contextlib.contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        yield


class CallableEvent(Timed):
    """`event` an object whose `__call__` is async (a metrics client's sender, say)."""

    def __init__(self) -> None:
        self.event = AsyncCallable()


class ReturnsCoroutine(Timed):
    """`event` a plain function that hands the work to a coroutine it forgets to schedule."""

    def event(self, event: Event, attributes: Mapping[str, Any]) -> Any:
        return self._send(event)

    async def _send(self, event: Event) -> None:
        SENT.append(event)


class Recorder(Timed):
    def __init__(self) -> None:
        self.events: list[str] = []

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        self.events.append(event.value)


def test_an_event_object_with_an_async_call_is_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match=r"CallableEvent\.event is async"):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), observers=[CallableEvent()])


async def pay(request: Request) -> Response:
    await request.body()
    return JSONResponse({"ok": True}, status_code=201)


async def test_an_event_that_returns_a_coroutine_is_the_observers_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    SENT.clear()
    recorder = Recorder()
    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        observers=[ReturnsCoroutine(), recorder],
        tenant_resolver=lambda scope: "t",
    )
    caplog.set_level(logging.DEBUG, logger="idem_middleware")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with client(app) as c:
            for _ in range(2):
                answer = await c.post("/pay", json={}, headers={"idempotency-key": "k1"})
                assert answer.status_code == 201
        await asyncio.sleep(0)
        gc.collect()
    # The answers and the other observer are as if it were not there.
    assert recorder.events == ["claimed", "succeeded", "replayed"]
    assert SENT == []
    # Its coroutines are closed, not left to warn "never awaited" with no observer named...
    assert not [w for w in caught if "never awaited" in str(w.message)]
    # ...and its failure is logged as any observer's: once at WARNING, naming it.
    failures = [r for r in caplog.records if "the observer ReturnsCoroutine failed" in r.message]
    assert [r.levelno for r in failures] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert failures[0].exc_info is not None
    assert "awaitable" in str(failures[0].exc_info[1])
