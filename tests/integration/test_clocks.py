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
    jobs_lease,
    jobs_transactional,
    lease,
    lease_executor,
    waiting,
)
from idem_middleware.context import IdempotencyContext
from idem_middleware.jobs import idempotent_job
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


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_job_waits_its_whole_wait_however_many_polls_it_takes(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch, mode: Mode
) -> None:
    """Found by probing: a run waiting for another run of its key gave up after 10,000 looks (a
    poll every half second at most: 83 minutes), whatever its `wait_seconds`, with a
    RuntimeError ("the record kept changing"). The looks are bounded by the wait now: its polls,
    and as many more (here a few, so that the polls outnumber them)."""
    monkeypatch.setattr(waiting, "MAX_ROUNDS", 2)
    # (Where the fixed bound lived before: the test fails there without the fix.)
    monkeypatch.setattr(jobs_lease, "MAX_ROUNDS", 2, raising=False)
    monkeypatch.setattr(jobs_transactional, "MAX_ROUNDS", 2, raising=False)
    looks = 0
    looked = asyncio.Event()
    get, transaction = pg_store.get, pg_store.transaction

    def counted(method: Any) -> Any:
        def look(*args: Any, **kwargs: Any) -> Any:
            nonlocal looks
            looks += 1
            if looks >= 8:
                looked.set()
            return method(*args, **kwargs)

        return look

    release, entered = asyncio.Event(), asyncio.Event()
    runs: list[int] = []

    @idempotent_job(pg_store, operation="long", key="k", mode=mode, wait_seconds=4 * BOUND)
    async def long(ctx: IdempotencyContext, k: str) -> int:
        runs.append(1)
        entered.set()
        await asyncio.wait_for(release.wait(), 4 * BOUND)
        return 7

    first = asyncio.ensure_future(long(k=f"long-{mode.value}"))
    await asyncio.wait_for(entered.wait(), BOUND)
    monkeypatch.setattr(pg_store, "get", counted(get))
    monkeypatch.setattr(pg_store, "transaction", counted(transaction))
    second = asyncio.ensure_future(long(k=f"long-{mode.value}"))
    looking = asyncio.ensure_future(looked.wait())  # more looks than MAX_ROUNDS + 1
    await asyncio.wait({second, looking}, timeout=4 * BOUND, return_when="FIRST_COMPLETED")
    looking.cancel()
    assert not second.done(), f"the wait ended before its wait_seconds: {second.exception()!r}"
    assert looked.is_set()
    release.set()
    assert await asyncio.wait_for(first, BOUND) == 7
    assert await asyncio.wait_for(second, BOUND) == 7  # the first run's result, after the wait
    assert runs == [1]


async def test_a_lease_mode_duplicate_waits_its_whole_wait_however_many_polls_it_takes(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bound for a request waiting for its original (a poll a second at most)."""
    monkeypatch.setattr(waiting, "MAX_ROUNDS", 2)
    monkeypatch.setattr(lease, "_MAX_ROUNDS", 2)  # (the fixed bound before: fails without)
    release, entered, looked = asyncio.Event(), asyncio.Event(), asyncio.Event()
    calls: list[int] = []

    async def handler(request: Request) -> Response:
        calls.append(1)
        entered.set()
        await asyncio.wait_for(release.wait(), 4 * BOUND)
        return JSONResponse({"ok": True}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=60, wait_seconds=4 * BOUND)
    app = one_route_app(PATH, handler, store=pg_store, policies={f"POST {PATH}": policy})
    get = pg_store.get
    looks = 0

    async def look(key: RecordKey) -> Any:
        nonlocal looks
        looks += 1
        if looks >= 5:
            looked.set()
        return await get(key)

    headers = {"Idempotency-Key": "long-wait"}
    async with client(app) as http:
        first = asyncio.ensure_future(http.post(PATH, headers=headers, json={}))
        await asyncio.wait_for(entered.wait(), BOUND)
        monkeypatch.setattr(pg_store, "get", look)
        second = asyncio.ensure_future(http.post(PATH, headers=headers, json={}))
        looking = asyncio.ensure_future(looked.wait())
        await asyncio.wait({second, looking}, timeout=4 * BOUND, return_when="FIRST_COMPLETED")
        looking.cancel()
        assert not second.done(), f"the wait ended before its wait_seconds: {second.result()}"
        assert looked.is_set()
        release.set()
        answers = [await asyncio.wait_for(r, BOUND) for r in (first, second)]
    assert [a.status_code for a in answers] == [201, 201], answers[1].text
    assert answers[1].headers.get("idempotent-replayed") == "true"
    assert calls == [1]
