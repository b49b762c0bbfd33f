"""Holders, duplicates, handler errors, clients that leave and cancelled requests, at random,
against the real store: afterwards nothing a request held is still held, in the process (the
middleware's waiters, held keys and tenant slots, the listener's watches and registrations, the
timers' items) or in the database (pool connections, open transactions, advisory locks, wait
registrations)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Policy
from idem_middleware.lease_executor import _RENEWALS
from idem_middleware.policy import Mode
from idem_middleware.store.postgres import PostgresStore
from idem_middleware.transactional import _WATCH

pytestmark = pytest.mark.asyncio


async def handler(request: Request) -> Response:
    await request.body()
    how = request.headers.get("x-how", "ok")
    if how == "slow":
        await asyncio.sleep(0.01)
    elif how == "raise":
        raise RuntimeError("boom")
    elif how == "hang":
        await asyncio.sleep(10)
    elif how == "stream":

        async def chunks() -> Any:
            for _ in range(3):
                yield b"x" * 10
                await asyncio.sleep(0.002)

        return StreamingResponse(chunks(), status_code=201)
    elif how == "500":
        return JSONResponse({}, status_code=500)
    return JSONResponse({"ok": True}, status_code=201)


def tenant_of(scope: Any) -> str:
    return dict(scope["headers"]).get(b"x-tenant", b"t").decode()


async def call(app: Any, key: str, tenant: str, how: str, leave_after: float | None) -> None:
    headers = [
        (b"host", b"test"),
        (b"idempotency-key", key.encode()),
        (b"x-tenant", tenant.encode()),
        (b"x-how", how.encode()),
        (b"content-type", b"application/json"),
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/pay",
        "raw_path": b"/pay",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    delivered = False
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            gone.set()

    if leave_after is not None:
        asyncio.get_running_loop().call_later(leave_after, gone.set)
    await app(scope, receive, send)


def items(delayed: Any) -> int:
    servings = [delayed._main, *(delayed._others or {}).values()]
    return sum(len(serving.items) for serving in servings if serving is not None)


def in_process(mw: IdempotencyMiddleware, store: PostgresStore) -> dict[str, Any]:
    listener = store._listener
    return {
        "held keys": len(mw.waiters.held),
        "waiting places": mw.waiters.count,
        "wait events": len(mw.waiters._events),
        "tenant slots": dict(mw.tenant_slots._held),
        "watches": len(listener._waiters),
        "registrations": len(listener._pending),
        "client watches": items(_WATCH),
        "renewals": sum(items(d) for d in _RENEWALS.values()),
    }


async def in_database(pool: Any) -> dict[str, Any]:
    return {
        "open transactions": await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state LIKE 'idle in transaction%'"
        ),
        "advisory locks": await pool.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        ),
        "wait registrations": await pool.fetchval("SELECT count(*) FROM idem_waiters"),
        "pending records": await pool.fetchval(
            "SELECT count(*) FROM idem_requests WHERE state = 'pending'"
        ),
    }


async def storm(mw: IdempotencyMiddleware, rng: random.Random, rounds: int) -> None:
    for _ in range(rounds):
        tasks = []
        for _ in range(rng.randint(3, 10)):
            how = rng.choice(["ok", "slow", "raise", "hang", "stream", "500", "slow"])
            leave = rng.choice([None, None, rng.random() * 0.05])
            key, tenant = f"k{rng.randint(0, 3)}", f"t{rng.randint(0, 1)}"
            tasks.append(asyncio.ensure_future(call(mw, key, tenant, how, leave)))
            if rng.random() < 0.5:
                await asyncio.sleep(rng.random() * 0.005)
        await asyncio.sleep(rng.random() * 0.03)
        for task in tasks:
            if rng.random() < 0.4:
                task.cancel()
        await asyncio.wait(tasks, timeout=1)  # (then the rest are cancelled too)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_nothing_stays_held_after_a_storm_of_cancellations_and_errors(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    app = Starlette(routes=[Route("/pay", handler, methods=["POST"])])
    policy = Policy(mode=mode, wait_seconds=0.3, lease_seconds=3.0)
    mw = IdempotencyMiddleware(
        app,
        store=pg_store,
        default_policy=policy,
        max_waiters=6,
        max_tenant_connections=2,
        tenant_resolver=tenant_of,
    )
    await storm(mw, random.Random(20261207), rounds=25)
    # (Registrations end in tasks of their own, and a cancelled request's connection goes back
    # to the pool in a shielded release that finishes after the cancellation: bounded waits.)
    for _ in range(200):
        if not any(in_process(mw, pg_store).values()) and pool.get_idle_size() == pool.get_size():
            break
        await asyncio.sleep(0.01)
    assert not any(in_process(mw, pg_store).values()), in_process(mw, pg_store)
    assert pool.get_idle_size() == pool.get_size()  # every connection back in the pool
    found = await in_database(pool)
    if mode is Mode.LEASE:
        found.pop("pending records")  # (a cancelled execution's claim lapses: by design)
    assert not any(found.values()), found
