"""A lease-mode duplicate of a request this process runs (its key in `Waiters.held`) is woken as
that request ends, LISTEN or not: without LISTEN (PgBouncer's transaction pooling, `listen=False`)
it was answered only at its next poll, up to a second after the original's end (the in-process
wake-up reached transactional duplicates alone). Here the polls are 5 s apart, so only the
wake-up can answer it in time."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import MemoryStore, Mode, Policy, PostgresStore
from idem_middleware import lease as lease_module
from tests.apps import BOUND, client, idempotency_middleware, key, one_route_app, wait_for_waiters


class Gated:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.runs = 0

    async def pay(self, request: Request) -> Response:
        await request.body()
        self.runs += 1
        self.entered.set()
        await self.gate.wait()
        if request.query_params.get("fail"):
            raise RuntimeError("the handler failed")
        return JSONResponse({"run": self.runs}, status_code=201)


@pytest.fixture(params=["memory", "postgres, no LISTEN"])
async def store(request: pytest.FixtureRequest, pool: Any) -> Any:
    """PostgreSQL without LISTEN is the case the wake-up closes; MemoryStore, whose own watch
    wakes its waiters in-process either way, checks the held path answers alike there."""
    if request.param == "memory":
        yield MemoryStore()
        return
    async with PostgresStore(pool=pool, listen=False) as pg:
        yield pg


async def _duplicate_after_the_original(
    store: Any, monkeypatch: pytest.MonkeyPatch, query: str = ""
) -> tuple[Any, Any, float, Gated, Any]:
    monkeypatch.setattr(lease_module, "_FIRST_POLL", 5.0)
    monkeypatch.setattr(lease_module, "_MAX_POLL", 5.0)
    gated = Gated()
    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=8.0)
    app = one_route_app("/pay", gated.pay, store=store, default_policy=policy)
    async with client(app) as http:
        first = asyncio.ensure_future(http.post("/pay" + query, json={}, headers=key("k")))
        try:
            await asyncio.wait_for(gated.entered.wait(), BOUND)
            duplicate = asyncio.ensure_future(http.post("/pay" + query, json={}, headers=key("k")))
            await wait_for_waiters(app, 1)
        finally:
            gated.gate.set()
        ended = time.monotonic()
        answers = await asyncio.wait_for(asyncio.gather(first, duplicate), BOUND)
        took = time.monotonic() - ended
    return answers[0], answers[1], took, gated, app


async def test_a_duplicate_is_replayed_as_the_original_ends(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, duplicate, took, gated, app = await _duplicate_after_the_original(store, monkeypatch)
    assert first.status_code == 201, first.text
    assert duplicate.status_code == 201, duplicate.text
    assert duplicate.headers.get("idempotent-replayed") == "true"
    assert took < 2.0  # (its next poll was 5 s away)
    assert gated.runs == 1
    mw = idempotency_middleware(app)
    assert (mw.waiters.held, mw.waiters.count, mw.waiters._events) == ({}, 0, {})


async def test_a_duplicate_of_an_original_that_failed_is_answered_as_it_ends(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, duplicate, took, gated, _ = await _duplicate_after_the_original(
        store, monkeypatch, "?fail=1"
    )
    assert first.status_code == 500
    assert took < 2.0
    # (A lease handler that raised may have had its effect: the record is `unknown`.)
    assert duplicate.status_code == 409, duplicate.text
    assert duplicate.json()["type"].endswith("outcome-unknown")
    assert gated.runs == 1
