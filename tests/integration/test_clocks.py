"""Whose clock decides (docs/scaling.md, "One clock"): the database's for every expiry, the event
loop's monotonic clock for every duration the application times itself. The application's wall
clock decides nothing, however far off it is; the loop's clock is read where a duration starts,
not where the loop got round to it."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import (
    Mode,
    Policy,
    PostgresStore,
    RecordKey,
    State,
    StoredResponse,
    lease_executor,
)
from idem_middleware.store.base import Claimed, Existing, Settlement, TokenRefused
from tests.apps import BOUND, client, one_route_app

PATH = "/clocks"


async def test_a_renewal_started_late_counts_the_lease_from_the_claim_not_from_itself(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by probing: the first renewal took the lease to end two thirds of a lease after
    the heartbeat task started, not a lease after the claim. An event loop that ran late (a
    handler blocking it, a loop saturated) started the heartbeat late, and an execution whose
    renewals could not reach the database went on believing it held the record for as long
    again past the lease's real end, when another process could take it over. The first renewal
    is due a third of a lease after the execution started: the lease granted ends a lease after
    that start, whenever the loop got round to the renewal."""
    lease = 0.3
    granted: list[float] = []
    renewing = asyncio.Event()
    keep_lease = lease_executor.keep_lease

    async def recorded(*args: Any, held_until: float, **kwargs: Any) -> None:
        granted.append(held_until)
        renewing.set()
        await keep_lease(*args, held_until=held_until, **kwargs)

    monkeypatch.setattr(lease_executor, "keep_lease", recorded)
    entered: list[float] = []

    async def handler(request: Request) -> Response:
        entered.append(asyncio.get_running_loop().time())
        time.sleep(lease * 1.5)  # noqa: ASYNC251 - the loop blocked: the first renewal falls due
        await asyncio.wait_for(renewing.wait(), BOUND)
        return JSONResponse({"ok": True}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=lease, wait_seconds=0.3)
    app = one_route_app(PATH, handler, store=pg_store, policies={f"POST {PATH}": policy})
    async with client(app) as http:
        response = await http.post(PATH, headers={"Idempotency-Key": "late-renewal"}, json={})
    assert response.status_code == 201, response.text
    assert len(granted) == 1
    assert len(entered) == 1
    # The claim committed before the handler was entered: its lease ends a lease after that at
    # the latest (by the database's clock, which runs at the same pace).
    assert granted[0] <= entered[0] + lease, (
        "the first renewal counted the lease from its own late start, past the lease's end"
    )


class SkewedWallClock:
    """This process's wall clock, minutes off (as a host minutes off the database's, or one that
    NTP stepped, is): `time.time` replaced, and `datetime.now` with it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, offset: float) -> None:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + offset)


@pytest.mark.parametrize("offset", [-600.0, 600.0], ids=["behind", "ahead"])
async def test_an_application_wall_clock_minutes_off_decides_no_expiry(
    pool: asyncpg.Pool[Any], pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch, offset: float
) -> None:
    """Leases, retention and tokens are judged by the database's clock alone: a process whose
    wall clock is ten minutes behind or ahead neither takes over a live lease nor marks it
    unknown, nor finds a retained outcome expired, nor refuses a live token, nor accepts an
    expired one."""
    SkewedWallClock(monkeypatch, offset)
    operation = f"POST {PATH}"
    live, spent = f"live-{offset}", f"spent-{offset}"
    for token in (live, spent):
        digest = hashlib.sha256(token.encode()).digest()
        await pg_store.issue_token(
            "tenant-a", digest, operation, request_digest=None, intent_id=None, ttl_seconds=60
        )
    await pool.execute(
        "UPDATE idem_tokens SET expires_at = now() WHERE token_hash = $1",
        hashlib.sha256(spent.encode()).digest(),
    )
    key = RecordKey("tenant-a", operation, live)
    claim = await pg_store.claim_lease(
        key,
        b"f" * 32,
        retention_seconds=60,
        lease_seconds=60,
        token_hash=hashlib.sha256(live.encode()).digest(),
    )
    assert isinstance(claim, Claimed)
    record = await pg_store.get(key)
    assert record is not None
    assert not record.lease_expired
    assert await pg_store.takeover(key, claim.generation, State.PENDING, 60) is None
    assert not await pg_store.expire_lease(key, claim.generation)
    assert await pg_store.heartbeat(key, claim.generation, 60)
    response = StoredResponse(201, [], b"{}", None)
    settlement = Settlement(State.SUCCEEDED, response)
    assert await pg_store.settle(key, claim.generation, State.PENDING, settlement)
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert not record.expired
    again = await pg_store.claim_lease(key, b"f" * 32, retention_seconds=60, lease_seconds=60)
    assert isinstance(again, Existing)  # replayed, not run again
    refused = await pg_store.claim_lease(
        RecordKey("tenant-a", operation, spent),
        b"f" * 32,
        retention_seconds=60,
        lease_seconds=60,
        token_hash=hashlib.sha256(spent.encode()).digest(),
    )
    assert isinstance(refused, TokenRefused)
