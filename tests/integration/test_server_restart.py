"""The store's PostgreSQL stopped and started again (a fast shutdown: every session ended) while
the library's long-lived parts run: lease renewals, waiting duplicates, the LISTEN connection,
the pool. Each test drives the restart itself on a server of this module's own
(tests/restarts.py) and waits on conditions, in bounded loops.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Policy, PostgresStore, get_context
from idem_middleware.outbox import OutboxEvent, Publisher, add
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey, State
from tests.apps import assert_replay_of, client, one_route_app
from tests.apps.concurrency import wait_for_waiters
from tests.pgbouncer import PgBouncer, binary
from tests.restarts import OwnServer

#: The most any condition is waited for (a bound, not a timing: each wait ends on its condition).
BOUND = 30.0


async def until(predicate: Any, what: str) -> None:
    for _ in range(int(BOUND / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


KEY = RecordKey("tenant-a", "POST /charges", "restart")
HEADERS = {"Idempotency-Key": "restart"}


async def test_a_lease_the_store_cannot_renew_for_its_whole_length_is_lost(
    own_server: OwnServer, own_dsn: str
) -> None:
    """The server stops while a lease-mode handler runs: every renewal fails. Once the lease
    has run out, another request may take the record over at any moment, so `lease_lost` is
    set. It was never set: a failed renewal counted as alive, however long the store stayed
    unreachable. Once the server is back and nobody took the record over, the settlement's
    compare-and-set still records the outcome."""
    entered, back = asyncio.Event(), asyncio.Event()
    noticed: list[bool] = []

    async def charge(request: Request) -> Response:
        ctx = get_context(request)
        entered.set()
        try:
            await asyncio.wait_for(ctx.lease_lost.wait(), BOUND)
        except TimeoutError:
            noticed.append(False)
        else:
            noticed.append(True)
        await asyncio.wait_for(back.wait(), BOUND)
        return JSONResponse({"lost": noticed[-1]}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=0.6, wait_seconds=0.3)
    async with PostgresStore(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
        async with client(app) as c:
            first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await asyncio.wait_for(entered.wait(), BOUND)
            await asyncio.to_thread(own_server.stop)
            await until(lambda: noticed, "the handler returned")
            await asyncio.to_thread(own_server.start)
            back.set()
            response = await asyncio.wait_for(first, BOUND)
            assert noticed == [True]
            assert response.status_code == 201, response.text
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.SUCCEEDED
            assert_replay_of(await c.post("/charges", json={}, headers=HEADERS), response)


async def test_a_duplicate_waiting_across_a_restart_gets_the_outcome(
    own_server: OwnServer, own_dsn: str
) -> None:
    """A lease-mode duplicate waits for the request that holds its key; the server restarts
    meanwhile, and the holder's outcome is recorded once it is back. The waiter, woken when the
    LISTEN connection died, re-read the record while the server was down and was answered 503
    at once, with most of its wait left. Now it holds nothing and polls on, and gets the outcome
    within its wait. The LISTEN connection is made again for the next waiter."""
    entered, release = asyncio.Event(), asyncio.Event()
    runs: list[int] = []

    async def charge(request: Request) -> Response:
        get_context(request)
        runs.append(1)
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return JSONResponse({"run": len(runs)}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=BOUND, wait_seconds=BOUND)
    async with PostgresStore(dsn=own_dsn, min_size=1, max_size=2) as store:
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
        async with client(app) as c:
            first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await asyncio.wait_for(entered.wait(), BOUND)
            waiter = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await wait_for_waiters(app)
            await until(store._listener.connected, "the LISTEN connection is up")
            await asyncio.to_thread(own_server.stop)
            await asyncio.to_thread(own_server.start)
            release.set()
            original = await asyncio.wait_for(first, BOUND)
            assert original.status_code == 201, original.text
            assert_replay_of(await asyncio.wait_for(waiter, BOUND), original)
            assert runs == [1]

            # The next waiter makes the LISTEN connection again.
            entered.clear()
            release.clear()
            again = {"Idempotency-Key": "restart-2"}
            second = asyncio.create_task(c.post("/charges", json={}, headers=again))
            await asyncio.wait_for(entered.wait(), BOUND)
            duplicate = asyncio.create_task(c.post("/charges", json={}, headers=again))
            await until(store._listener.connected, "the LISTEN connection is made again")
            release.set()
            assert_replay_of(await asyncio.wait_for(duplicate, BOUND), await second)


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_a_burst_right_after_a_restart_is_served(
    own_server: OwnServer, own_dsn: str, mode: str
) -> None:
    """Every connection of the pool died with the server; right after it is back, a burst of
    twice the pool's size is served, none answered 503: asyncpg saw the connections closed
    when the server ended them, and opens new ones at the checkouts."""

    async def charge(request: Request) -> Response:
        get_context(request)
        await asyncio.sleep(0.01)  # (the requests overlap)
        return JSONResponse({}, status_code=201)

    policy = Policy(mode=Mode.LEASE) if mode == "lease" else Policy()
    async with PostgresStore(dsn=own_dsn, min_size=3, max_size=3, listen=False) as store:
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
        async with client(app) as c:

            async def burst(prefix: str) -> list[int]:
                sent = (
                    c.post("/charges", json={}, headers={"Idempotency-Key": f"{prefix}-{i}"})
                    for i in range(6)
                )
                return [r.status_code for r in await asyncio.gather(*sent)]

            assert await burst("before") == [201] * 6
            assert store.pool.get_size() == 3
            await asyncio.to_thread(own_server.stop)
            await asyncio.to_thread(own_server.start)
            assert await burst("after") == [201] * 6


async def test_an_outbox_publisher_backs_off_while_the_server_is_down_then_resumes(
    own_server: OwnServer, own_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A running publisher whose server stops: each failed batch is logged, then waited after,
    from `idle_seconds` doubling, and the same publisher sends again once the server is back.
    With `base_backoff_seconds=0` (events retried at once) it retried at once too: a tight loop
    logging a traceback per refused connection (some 1,000 a second)."""
    caplog.set_level(logging.WARNING, "idem_middleware.outbox")
    sent: list[Any] = []

    async def sender(event: OutboxEvent) -> bool:
        sent.append(event.payload)
        return True

    def failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage() == "outbox batch failed; retrying"]

    async with PostgresStore(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        async with store.pool.acquire() as conn:
            await add(conn, "t", {"n": 1})
        stop = asyncio.Event()
        publisher = Publisher(store, sender, base_backoff_seconds=0.0)
        running = asyncio.create_task(publisher.run(stop=stop, idle_seconds=0.05))
        try:
            await until(lambda: sent, "the first event sent")
            await asyncio.to_thread(own_server.stop)
            await until(lambda: len(failed()) >= 4, "four failed batches")
            await asyncio.to_thread(own_server.start)
            async with store.pool.acquire() as conn:
                await add(conn, "t", {"n": 2})
            await until(lambda: len(sent) == 2, "the event added after the restart sent")
        finally:
            stop.set()
            await asyncio.wait_for(running, BOUND)
    assert sent == [{"n": 1}, {"n": 2}]
    times = [r.created for r in failed()[:4]]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    # (Lower bounds only: each wait is at least its backoff; 0.9 for the log's wall clock.)
    assert all(gap >= 0.9 * 0.05 * 2**i for i, gap in enumerate(gaps)), gaps


@pytest.mark.skipif(binary() is None, reason="pgbouncer is not installed")
async def test_a_publisher_through_pgbouncer_sends_again_after_the_server_restarts(
    own_server: OwnServer, own_dsn: str
) -> None:
    """The publisher on PgBouncer in transaction pooling mode (no statement cache) while the
    server behind it restarts: PgBouncer stays up, its server connections die, and the same
    publisher sends the event added before and the one added after."""
    sent: list[Any] = []

    async def sender(event: OutboxEvent) -> bool:
        sent.append(event.payload)
        return True

    bouncer = await asyncio.to_thread(PgBouncer(own_dsn, settings={"server_login_retry": 1}).start)
    database = urlsplit(own_dsn).path.lstrip("/")
    try:
        async with PostgresStore(
            dsn=bouncer.dsn(database), min_size=1, max_size=2, listen=False, statement_cache_size=0
        ) as store:
            async with store.pool.acquire() as conn:
                await add(conn, "t", {"n": 1})
            stop = asyncio.Event()
            publisher = Publisher(store, sender, base_backoff_seconds=0.0)
            running = asyncio.create_task(publisher.run(stop=stop, idle_seconds=0.05))
            try:
                await until(lambda: sent, "the first event sent")
                await asyncio.to_thread(own_server.stop)
                await asyncio.to_thread(own_server.start)
                # (Added on the server itself: PgBouncer refuses clients for a while after a
                # failed server login, `server_login_retry`; the publisher rides that out.)
                direct = await asyncpg.connect(own_dsn)
                try:
                    await add(direct, "t", {"n": 2})
                finally:
                    await direct.close()
                await until(lambda: len(sent) == 2, "the event added after the restart sent")
            finally:
                stop.set()
                await asyncio.wait_for(running, BOUND)
    finally:
        await asyncio.to_thread(bouncer.stop)
    assert sent == [{"n": 1}, {"n": 2}]
