"""A duplicate waiting in this process for a transactional request's key is woken only once that
request lets go of what the duplicate needs: when its response starts streaming, after its
connection and its tenant's slot are given back (woken before, the duplicate found the slot
taken, and waited again for a holder that was gone, until its next poll)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Policy, PostgresStore
from idem_middleware.waiting import Waiters
from tests.apps import BOUND, client, key, until


async def _events() -> AsyncIterator[bytes]:
    yield b"data: 0\n\n"


async def test_a_stream_wakes_its_duplicate_once_its_slot_is_free(
    pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = asyncio.Event()
    runs: list[int] = []

    async def feed(request: Request) -> Any:
        runs.append(1)
        await gate.wait()
        return StreamingResponse(_events(), 201, media_type="text/event-stream")

    app = Starlette(routes=[Route("/feed", feed, methods=["POST"])])
    mw = IdempotencyMiddleware(
        app,
        store=PostgresStore(pool=pool),
        default_policy=Policy(wait_seconds=10),
        tenant_resolver=lambda scope: "tenant-a",
        max_tenant_connections=1,
    )
    # Each wait of a duplicate: whether the key was still held by the request it duplicates.
    waits: list[bool] = []
    wait = Waiters.wait

    def recorded(self: Waiters, key: Hashable, seconds: float) -> Any:
        waits.append(key in self.held)
        return wait(self, key, seconds)

    monkeypatch.setattr(Waiters, "wait", recorded)

    async def post() -> Any:
        async with client(mw, token=None) as c:  # type: ignore[arg-type]
            return await c.post("/feed", json={}, headers=key("k"))

    first = asyncio.ensure_future(post())
    await until(lambda: bool(mw.waiters.held))
    duplicate = asyncio.ensure_future(post())
    await until(lambda: mw.waiters.count == 1)
    gate.set()
    answers = await asyncio.wait_for(asyncio.gather(first, duplicate), BOUND)
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[1].headers.get("idempotent-replayed") == "true"
    assert runs == [1]
    assert waits, "the duplicate never waited"
    assert all(waits), "the duplicate waited again after its holder let go of the key"
