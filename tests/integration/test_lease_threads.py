"""Lease mode with several event loops in one process: each thread serves its own app (with its
own store and pool, as asyncpg requires) and they share the module's heartbeat timers."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from tests.apps import BOUND, LEASE_POLICY, PAYOUTS, Step, build_lease_app, client, reset_downstream

LEASE = 0.6
KEYS = ("one", "two")


class Server:
    """One thread's event loop serving the lease app; its handler is held until `release`."""

    def __init__(self, dsn: str, key: str) -> None:
        self.dsn = dsn
        self.key = key
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gate: asyncio.Event | None = None
        self.status: int | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()))

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.gate = asyncio.Event()
        pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4)
        try:
            async with PostgresStore(pool=pool, listen=False) as store:
                app = build_lease_app(store, pool, LEASE_POLICY.replace(lease_seconds=LEASE))
                app.state.probe.steps = [Step(gate=self.gate)]
                self.ready.set()
                async with client(app) as c:
                    answer = c.post(PAYOUTS, json={"account": "a", "amount": 1}, headers=key(self))
                    self.status = (await asyncio.wait_for(answer, 4 * BOUND)).status_code
        finally:
            self.ready.set()
            await pool.close()

    def release(self) -> None:
        if self.loop is not None and self.gate is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.gate.set)


def key(server: Server) -> dict[str, str]:
    return {"idempotency-key": server.key}


async def renewed(pool: asyncpg.Pool[Any]) -> set[str]:
    """The keys whose lease a heartbeat renewed (the claim set it to created_at + the lease)."""
    rows = await pool.fetch(
        "SELECT idem_key FROM idem_requests WHERE state = 'pending'"
        " AND lease_expires_at > created_at + make_interval(secs => $1)",
        LEASE,
    )
    return {row["idem_key"] for row in rows}


async def test_each_threads_loop_renews_the_leases_of_its_own_handlers(
    db_dsn: str, pool: asyncpg.Pool[Any]
) -> None:
    """The second loop's first execution took the shared renewal timer over and dropped the
    first loop's executions: their heartbeats never started, and the leases of handlers still
    running lapsed (a duplicate would then take the claim over, or mark it unknown)."""
    await reset_downstream(pool)
    servers = [Server(db_dsn, k) for k in KEYS]
    try:
        for server in servers:  # one after the other: the second comes while the first runs
            server.thread.start()
            await asyncio.to_thread(server.ready.wait, BOUND)
            await _until_claimed(pool, server.key)
        deadline = time.monotonic() + BOUND
        while (seen := await renewed(pool)) != set(KEYS):
            if time.monotonic() > deadline:
                pytest.fail(f"only {sorted(seen)} of {KEYS} had their leases renewed")
            await asyncio.sleep(0.02)
    finally:
        for server in servers:
            server.release()
        for server in servers:
            await asyncio.to_thread(server.thread.join, 2 * BOUND)
    assert [server.status for server in servers] == [201, 201]


async def _until_claimed(pool: asyncpg.Pool[Any], idem_key: str) -> None:
    deadline = time.monotonic() + BOUND
    while not await pool.fetchval("SELECT 1 FROM idem_requests WHERE idem_key = $1", idem_key):
        if time.monotonic() > deadline:
            pytest.fail(f"{idem_key} was never claimed")
        await asyncio.sleep(0.01)
