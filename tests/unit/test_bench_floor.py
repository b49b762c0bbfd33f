"""bench.floor.FloorMiddleware, the yardstick of the `floor-memory` variant: it does what it
claims to (claim, hold, record, replay, refuse another body), or its numbers would mean nothing."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace
from typing import Any

from bench.floor import FloorMiddleware

USER = SimpleNamespace(is_authenticated=True, identity="tenant-a")


def _call(mw: FloorMiddleware, body: bytes, key: bytes | None, path: str = "/pay") -> list[Any]:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"idempotency-key", key))
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "user": USER}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Any] = []

    async def receive() -> Any:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    return sent


def _app() -> tuple[FloorMiddleware, list[bytes]]:
    runs: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        runs.append(body)
        start = {
            "type": "http.response.start",
            "status": 201,
            "headers": [(b"x-run", b"%d" % len(runs))],
        }
        await send(start)
        await send({"type": "http.response.body", "body": b"ran " + body})

    return FloorMiddleware(app), runs


def test_a_retry_is_replayed_without_running_the_handler_again() -> None:
    mw, runs = _app()
    first = _call(mw, b'{"a": 1, "b": 2}', b"k1")
    again = _call(mw, b'{"b": 2, "a": 1}', b"k1")  # the same JSON, another order
    assert runs == [b'{"a": 1, "b": 2}']
    assert first[0]["status"] == again[0]["status"] == 201
    assert again[1]["body"] == first[1]["body"]
    assert again[0]["headers"] == [(b"x-run", b"1"), (b"idempotent-replayed", b"true")]


def test_another_body_under_the_same_key_is_refused_and_no_key_passes_through() -> None:
    mw, runs = _app()
    _call(mw, b'{"a": 1}', b"k1")
    assert _call(mw, b'{"a": 2}', b"k1")[0]["status"] == 409
    _call(mw, b'{"a": 3}', None)
    _call(mw, b'{"a": 3}', None)
    assert runs == [b'{"a": 1}', b'{"a": 3}', b'{"a": 3}']


def test_its_records_leave_the_collectors_sight_as_the_memory_stores_do() -> None:
    mw, _ = _app()
    gc.collect()
    gc.disable()  # the two collections below are the only ones the records live through
    try:
        for i in range(20):
            _call(mw, b'{"n": %d}' % i, b"k%d" % i)
        gc.collect(0)
        gc.collect(1)
    finally:
        gc.enable()
    assert len(mw.records) == 20
    assert [k for k, v in mw.records.items() if gc.is_tracked(k) or gc.is_tracked(v)] == []
