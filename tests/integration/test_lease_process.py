"""Seed failure window "crash after claim", for real: a uvicorn worker SIGKILLed mid-handler.

The worker (tests/lease_app.py) commits its lease-mode claim, makes the downstream effect (a row
in `test_downstream`, the bank), and is killed before it answers. The record must stay `pending`
while the lease runs (the executor might only be slow), and once the lease lapses a retry against
a restarted process must never produce a second downstream effect:
- lapsed lease -> unknown, with a reconciler: the downstream row is found -> the reconciler's
  response is stored and replayed (201), the handler is not run again;
- lapsed lease -> unknown, without a reconciler: 409 outcome-unknown, the handler is not run;
- lapsed lease -> takeover: the handler runs again under a new generation with the same
  downstream key, so the bank deduplicates it: still one downstream row.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from example_app.launcher import ServerProcess
from idem_middleware import derive_downstream_key
from tests.apps import PROBLEM_BASE, downstream_rows, reset_downstream

LEASE_SECONDS = 1.0
#: The bound on every wait here; a process start is the slowest step (well under a second).
BOUND = 20.0
AUTH = {"authorization": "Bearer demo-a"}
BODY = {"account": "acc-1", "amount": 250}


@pytest.fixture
async def bank(pool: asyncpg.Pool[Any]) -> asyncpg.Pool[Any]:
    await reset_downstream(pool)
    return pool


@pytest.fixture
def servers(db_dsn: str) -> Iterator[list[ServerProcess]]:
    """Starts the lease app on demand (each start is a fresh process); cleans all up."""
    started: list[ServerProcess] = []
    yield started
    for proc in started:
        proc.cleanup()


def start(servers: list[ServerProcess], db_dsn: str) -> ServerProcess:
    proc = ServerProcess(
        "uvicorn",
        "tests.lease_app:create_app",
        "--factory",
        "--log-level",
        "warning",
        env={"LEASE_APP_DSN": db_dsn, "LEASE_APP_LEASE_SECONDS": str(LEASE_SECONDS)},
    )
    servers.append(proc)
    return proc.start(timeout=BOUND)


async def until(predicate: Any, what: str, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def record(pool: asyncpg.Pool[Any], idem_key: str) -> asyncpg.Record:
    row: asyncpg.Record | None = await pool.fetchrow(
        "SELECT state, generation, lease_expires_at > now() AS lease_live, response_status "
        "FROM idem_requests WHERE idem_key = $1",
        idem_key,
    )
    assert row is not None
    return row


async def calls(pool: asyncpg.Pool[Any], dkey: str) -> list[asyncpg.Record]:
    return await pool.fetch(
        "SELECT generation, pid FROM test_lease_calls WHERE dkey = $1 ORDER BY id", dkey
    )


@contextlib.asynccontextmanager
async def http(proc: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=proc.url, headers=AUTH, timeout=BOUND) as c:
        yield c


@pytest.mark.parametrize("route", ["reconciled", "plain", "takeover"])
async def test_seed_crash_after_claim_sigkill_mid_handler(
    servers: list[ServerProcess], db_dsn: str, bank: asyncpg.Pool[Any], route: str
) -> None:
    idem_key = f"crash-{route}-{uuid.uuid4().hex[:8]}"
    path = f"/payouts/{route}"
    headers = {"idempotency-key": idem_key}

    first = start(servers, db_dsn)
    async with http(first) as c:
        doomed = asyncio.create_task(c.post(path, json=BODY, headers={**headers, "x-hold": "60"}))
        # "Entered": the downstream effect is visible (the bank committed it on its own).
        # The record is claimed before the effect: its epoch names the downstream key.
        await until(lambda: _has_downstream(bank, path, idem_key), "the downstream effect")
        dkey = await _dkey(bank, path, idem_key)
        first.kill()
        with pytest.raises(httpx.TransportError):
            await asyncio.wait_for(doomed, BOUND)

    # Right after the crash: the claim is still pending under its lease, nobody can tell yet.
    crashed = await record(bank, idem_key)
    assert crashed["state"] == "pending"
    assert crashed["lease_live"], "the lease should not have lapsed yet"
    assert crashed["response_status"] is None
    runs = await calls(bank, dkey)
    assert [r["generation"] for r in runs] == [crashed["generation"]]
    assert await downstream_rows(bank, dkey) == 1

    # No heartbeat renews it any more: the lease lapses by the database's clock.
    async def lapsed() -> bool:
        return not (await record(bank, idem_key))["lease_live"]

    await until(lapsed, "the lease to lapse", bound=LEASE_SECONDS + BOUND)
    assert (await record(bank, idem_key))["state"] == "pending", (
        "a lapsed lease alone moves nothing"
    )

    second = start(servers, db_dsn)
    async with http(second) as c:
        retry = await c.post(path, json=BODY, headers=headers)
        again = await c.post(path, json=BODY, headers=headers)

    after = await record(bank, idem_key)
    runs = await calls(bank, dkey)
    assert await downstream_rows(bank, dkey) == 1, "the effect happened twice"
    if route == "reconciled":
        assert retry.status_code == 201, retry.text
        assert retry.headers.get("idempotent-replayed") == "true"
        assert retry.json() == {"dkey": dkey, "amount": BODY["amount"], "reconciled": True}
        assert after["state"] == "succeeded"
        assert after["generation"] == crashed["generation"]
        assert len(runs) == 1, "the handler ran again"
        assert again.status_code == 201
        assert again.content == retry.content
    elif route == "plain":
        assert retry.status_code == 409, retry.text
        assert retry.json()["type"] == PROBLEM_BASE + "outcome-unknown"
        assert after["state"] == "unknown"
        assert len(runs) == 1, "the handler ran again"
        assert again.status_code == 409
        assert again.json()["type"] == PROBLEM_BASE + "outcome-unknown"
    else:
        assert retry.status_code == 201, retry.text
        assert "idempotent-replayed" not in retry.headers
        body = retry.json()
        assert body["dkey"] == dkey, "a takeover must reuse the downstream key"
        assert body["generation"] > crashed["generation"]
        assert after["state"] == "succeeded"
        assert after["generation"] == body["generation"]
        assert [r["generation"] for r in runs] == [crashed["generation"], body["generation"]]
        assert runs[0]["pid"] != runs[1]["pid"]
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.content == retry.content


async def _dkey(pool: asyncpg.Pool[Any], path: str, idem_key: str) -> str:
    epoch = await pool.fetchval(
        "SELECT epoch FROM idem_requests WHERE idem_key = $1 AND epoch IS NOT NULL", idem_key
    )
    return derive_downstream_key("tenant-a", f"POST {path}", idem_key, epoch)


async def _has_downstream(pool: asyncpg.Pool[Any], path: str, idem_key: str) -> bool:
    return await downstream_rows(pool, await _dkey(pool, path, idem_key)) == 1
