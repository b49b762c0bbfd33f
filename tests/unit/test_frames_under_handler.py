"""The middleware's frames between a handler and its task. Every await of a handler that
suspends passes through each of them on its way back, so the request path keeps them few: the
exchange, and the mode's one frame that runs the handler (lease mode: the execution, which claims
the key in its own frame first; the `@idempotent` endpoint's own wrapper is the endpoint's)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import idem_middleware
from idem_middleware import MemoryStore, Mode, Policy
from tests.apps import client, key, one_route_app

_PACKAGE = str(Path(idem_middleware.__file__).parent)


def _middleware_frames(task: asyncio.Task[Any]) -> list[str]:
    """The qualified names of the middleware's coroutines in `task`'s await chain."""
    names = []
    awaited: Any = task.get_coro()
    for _ in range(200):  # bounded: a chain is a few dozen deep
        code = getattr(awaited, "cr_code", None)
        if code is None:
            break
        if code.co_filename.startswith(_PACKAGE):
            names.append(code.co_qualname)
        awaited = awaited.cr_await
    return names


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (Mode.TRANSACTIONAL, ["Exchange.run", "Attempt.run"]),
        (Mode.LEASE, ["Exchange.run", "LeaseExecution.run"]),
    ],
)
async def test_a_handler_awaits_under_the_exchange_and_one_run_of_its_mode(
    mode: Mode, expected: list[str]
) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()

    async def handler(request: Request) -> Response:
        entered.set()
        await gate.wait()
        return JSONResponse({"ok": True}, status_code=201)

    app = one_route_app("/pay", handler, store=MemoryStore(), default_policy=Policy(mode=mode))
    async with client(app) as c:
        request = asyncio.create_task(c.post("/pay", json={}, headers=key(f"frames-{mode}")))
        await asyncio.wait_for(entered.wait(), 5)
        frames = _middleware_frames(request)
        gate.set()
        r = await asyncio.wait_for(request, 5)
    assert r.status_code == 201
    assert frames == expected
