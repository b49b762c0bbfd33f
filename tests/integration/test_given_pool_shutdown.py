"""A store given the app's own pool and never opened counts as open: the middleware's startup
checks it, which opens the store's own two connections (the LISTEN one, for duplicates that
wait, and the lease renewals'), outside the pool. Found by probing: nothing closed them, so
they outlived the app's lifespan for as long as the event loop lived, two more at each test's
lifespan. The middleware's lifespan shutdown now closes them (the pool stays the app's)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from starlette.types import Message

from idem_middleware import Mode, PostgresStore, idempotent
from idem_middleware.fastapi import Idempotency, install

NAME = "given-app-pool"


async def _own_connections(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE $1",
            f"{NAME}.%",
        )
    finally:
        await conn.close()
    return sorted(row["application_name"] for row in rows)


async def test_the_lifespan_shutdown_closes_a_given_pool_stores_own_connections(
    db_dsn: str,
) -> None:
    pool = await asyncpg.create_pool(
        db_dsn, min_size=1, max_size=4, server_settings={"application_name": NAME}
    )
    try:
        app = FastAPI()

        @app.post("/pay")
        @idempotent(mode=Mode.LEASE, lease_seconds=0.3, wait_seconds=5)
        async def pay(idem: Idempotency) -> dict[str, int]:
            await asyncio.sleep(0.5)  # (a renewal or two on the renewals' connection)
            return {"ok": 1}

        install(app, store=PostgresStore(pool=pool), tenant_resolver=lambda scope: "t")
        incoming: asyncio.Queue[Message] = asyncio.Queue()
        sent: list[Message] = []
        started = asyncio.Event()

        async def send(message: Message) -> None:
            sent.append(message)
            if message["type"] == "lifespan.startup.complete":
                started.set()

        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        lifespan = asyncio.create_task(app(scope, incoming.get, send))
        await incoming.put({"type": "lifespan.startup"})
        await asyncio.wait_for(started.wait(), 10)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            key = {"Idempotency-Key": f"k{time.time()}"}  # (a duplicate waits: LISTEN)
            answers = await asyncio.gather(*[client.post("/pay", headers=key) for _ in range(2)])
        assert [a.status_code for a in answers] == [200, 200]
        assert await _own_connections(db_dsn) == [f"{NAME}.listen", f"{NAME}.renew"]
        await incoming.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(lifespan, 15)
        assert [m["type"] for m in sent][-1] == "lifespan.shutdown.complete"
        for _ in range(100):  # (bounded: the server ends a closed connection's backend soon)
            if not await _own_connections(db_dsn):
                break
            await asyncio.sleep(0.05)
        assert await _own_connections(db_dsn) == []
    finally:
        await pool.close()


Lifespan = tuple[asyncio.Queue[Message], list[Message], asyncio.Task[Any]]


async def _lifespan_of(app: Any) -> Lifespan:
    """An app's lifespan, started as a server starts it; its messages in, and what it sent."""
    incoming: asyncio.Queue[Message] = asyncio.Queue()
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.create_task(app(scope, incoming.get, send))
    await incoming.put({"type": "lifespan.startup"})
    for _ in range(1000):  # (bounded: until its startup completed)
        if sent:
            break
        await asyncio.sleep(0.005)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete"]
    return incoming, sent, task


async def _shut_down(
    lifespan: tuple[asyncio.Queue[Message], list[Message], asyncio.Task[Any]],
) -> list[str]:
    incoming, sent, task = lifespan
    await incoming.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(task, 15)
    return [m["type"] for m in sent]


async def test_two_lifespans_on_one_given_pool_store_and_a_failed_release(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review found that one app's shutdown let go of connections another app on the same
    store still served with, and that a release that raised kept the shutdown's message from
    the server and the connections from ever opening again."""
    store = PostgresStore(pool=pool)
    apps = [FastAPI(), FastAPI()]
    for app in apps:
        install(app, store=store, tenant_resolver=lambda scope: "t")
    first, second = [await _lifespan_of(app) for app in apps]
    assert not store._listener._stopped  # (resumed by the first startup's check)
    assert await _shut_down(first) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert store._given_checked  # the second app still serves with them: kept
    failed: list[int] = []

    async def refused(self: Any) -> None:
        failed.append(1)
        raise ConnectionResetError("the server went away")

    monkeypatch.setattr(PostgresStore, "_close_own_connections", refused)
    assert await _shut_down(second) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert failed == [1]
    assert not store._given_checked  # (the next startup opens them again)
    monkeypatch.undo()
    third = await _lifespan_of(apps[0])
    assert store._given_checked
    assert await _shut_down(third) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert not store._given_checked
