"""The `wait` step an observer times is the duplicate's wait for the key, and nothing after it:
a duplicate that claims the key once it is free runs its handler outside the wait's timer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from idem_middleware import MemoryStore, Mode, Policy
from tests.apps import client, one_route_app

HELD = 0.2  # how long the original holds the key
RUN = 0.6  # how long the duplicate's own run takes


class Timings:
    """An observer that records each timed step, and which steps are open (any request's)."""

    def __init__(self) -> None:
        self.open: list[str] = []
        self.steps: list[tuple[str, float]] = []

    def event(self, event: Any, attributes: Mapping[str, Any]) -> None:
        pass

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        self.open.append(name)
        started = time.monotonic()
        try:
            yield
        finally:
            self.open.remove(name)
            self.steps.append((name, time.monotonic() - started))


@pytest.mark.parametrize("mode", list(Mode))
async def test_a_duplicate_that_runs_after_its_wait_is_not_timed_as_waiting(mode: Mode) -> None:
    runs = 0
    inside: list[tuple[str, ...]] = []
    timings = Timings()

    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        if runs == 1:
            await asyncio.sleep(HELD)
            return PlainTextResponse("busy", 409)  # released: the duplicate claims it then
        inside.append(tuple(timings.open))
        await asyncio.sleep(RUN)
        return PlainTextResponse("paid", 201)

    app = one_route_app(
        "/pay",
        pay,
        store=MemoryStore(),
        default_policy=Policy(mode=mode, wait_seconds=5),
        observers=timings,
    )
    async with client(app) as c:
        first = asyncio.create_task(c.post("/pay", headers={"idempotency-key": "k"}))
        await asyncio.sleep(HELD / 4)
        second = await c.post("/pay", headers={"idempotency-key": "k"})
        assert isinstance(await first, httpx.Response)
    assert (first.result().status_code, second.status_code, runs) == (409, 201, 2)
    waits = [seconds for name, seconds in timings.steps if name == "wait"]
    assert len(waits) == 1
    assert waits[0] < HELD + RUN / 2, waits  # the wait, not the wait and the run
    assert inside == [()]  # the handler ran under no step's timer (the original had ended)
