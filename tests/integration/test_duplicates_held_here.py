"""A transactional duplicate of a request running in this process waits for it without asking
the pool for a connection, and its polls ask the store for nothing.

Found by probing a retry storm: with a pool of one, held by a slow handler, a duplicate queued
for the pool only to learn that the key was busy, and was answered 503 after `acquire_timeout`
instead of waiting `wait_seconds` for the replay; with a larger pool, each of its polls took a
connection and a transaction to learn the same.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, PostgresStore
from tests.apps import (
    BOUND,
    CountingStore,
    Held,
    QueryLog,
    build_app,
    client,
    idempotency_middleware,
    key,
    logged_pool,
    until,
    wait_entered,
    wait_for_waiters,
)

CREDIT = "/accounts/a1/credits"


async def _original_and_duplicate(app: Any, c: Any, held: Held) -> tuple[Any, Any]:
    """The original (its handler held) and its duplicate, once the duplicate waits."""
    first = held.start(c.post(CREDIT, json={"amount": 5}, headers=key("k")))
    await wait_entered(app.state.probe)
    duplicate = held.start(c.post(CREDIT, json={"amount": 5}, headers=key("k")))
    await wait_for_waiters(app, 1)
    return first, duplicate


async def test_with_the_pool_taken_by_the_holder_a_duplicate_waits_for_its_replay(
    db_dsn: str,
) -> None:
    async with logged_pool(db_dsn, QueryLog(), min_size=1, max_size=1) as pool:
        app = build_app(
            PostgresStore(pool=pool), default_policy=Policy(wait_seconds=10), acquire_timeout=0.3
        )
        probe = app.state.probe
        async with client(app) as c, Held(probe) as held:
            # It waits in the process (past the pool's 0.3 s), not in the pool's queue.
            first, duplicate = await _original_and_duplicate(app, c, held)
            await asyncio.sleep(0.5)
            assert not duplicate.done()
            held.release()
            answers = await asyncio.wait_for(asyncio.gather(first, duplicate), BOUND)
        assert [a.status_code for a in answers] == [201, 201]
        assert answers[1].headers.get("idempotent-replayed") == "true"
        assert answers[1].json() == answers[0].json()
        assert probe.calls == 1
        assert await pool.fetchval("SELECT count(*) FROM test_ledger") == 1


async def test_a_waiting_duplicates_polls_ask_the_store_nothing() -> None:
    store = CountingStore(MemoryStore())
    app = build_app(store, default_policy=Policy(wait_seconds=10))  # type: ignore[arg-type]
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first, duplicate = await _original_and_duplicate(app, c, held)
        await asyncio.sleep(1.2)  # its polls: after 20, 40, 80, 160, 320 and 500 ms
        assert store.calls == 1  # the holder's transaction only
        held.release()
        answers = await asyncio.wait_for(asyncio.gather(first, duplicate), BOUND)
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[1].headers.get("idempotent-replayed") == "true"
    assert store.calls == 2  # and the duplicate's one look, once woken: the replay
    assert idempotency_middleware(app).waiters.held == {}


async def _held_stream(gate: asyncio.Event) -> Any:
    yield b"first "
    await gate.wait()
    yield b"last"


@pytest.mark.parametrize("ending", ["response", "error", "cancelled", "stream"])
async def test_no_key_stays_held_after_its_request(ending: str) -> None:
    """However the holder's attempt ends, its key is let go of: a duplicate after it looks at the
    record (a replay, or a run of its own), never waits for a holder that is gone."""
    entered, gate = asyncio.Event(), asyncio.Event()
    runs: list[str] = []

    async def pay(request: Request) -> Any:
        runs.append(ending)
        entered.set()
        if ending == "stream":
            return StreamingResponse(_held_stream(gate), 201, media_type="text/event-stream")
        await gate.wait()
        if ending == "error":
            raise RuntimeError("the handler failed")
        return JSONResponse({"paid": True}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    mw = IdempotencyMiddleware(
        app,
        store=MemoryStore(),
        default_policy=Policy(wait_seconds=0.2),
        tenant_resolver=lambda scope: "tenant-a",
    )

    async def post() -> Any:
        async with client(mw, token=None) as c:  # type: ignore[arg-type]
            return await c.post("/pay", json={}, headers=key("k"))

    first = asyncio.ensure_future(post())
    await asyncio.wait_for(entered.wait(), BOUND)
    if ending == "stream":
        await until(lambda: not mw.waiters.held)  # settled before its first byte
        gate.set()
    elif ending == "cancelled":
        first.cancel()
    else:
        assert mw.waiters.held
        gate.set()
    await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), BOUND)
    assert mw.waiters.held == {}
    gate.set()
    retry = await asyncio.wait_for(post(), BOUND)
    if ending in ("error", "cancelled"):  # rolled back: the retry runs it (and fails again)
        assert len(runs) == 2
        assert retry.status_code == (500 if ending == "error" else 201)
    else:
        assert len(runs) == 1
        assert retry.headers.get("idempotent-replayed") == "true"


async def test_with_the_tenants_slots_taken_a_duplicate_waits_for_its_replay() -> None:
    """A duplicate of a request running in this process needs no tenant slot to wait (it asks
    the store nothing until the holder ends): with the tenant's one slot taken by the request it
    duplicates, it is answered that request's response, not 429."""
    app = build_app(MemoryStore(), default_policy=Policy(wait_seconds=10), max_tenant_connections=1)
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first, duplicate = await _original_and_duplicate(app, c, held)
        held.release()
        answers = await asyncio.wait_for(asyncio.gather(first, duplicate), BOUND)
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[1].headers.get("idempotent-replayed") == "true"
    assert probe.calls == 1
