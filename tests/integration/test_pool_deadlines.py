"""A transaction session's waits for the pool are bounded by its acquire timeout, with one timer
for all sessions (store/postgres/sessions.py): a checkout that finds no free connection gives
up, and a connection that cannot come back (its server stopped answering during the rollback
or the reset) is terminated rather than holding the request forever. The unresponsive server
is real: its backend process is stopped with SIGSTOP and resumed afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, RecordKey, StoreError
from idem_middleware.store.base import Claimed
from tests.apps import assert_problem, client, key, one_route_app

BOUND = 10.0
DEADLINE = 0.3


def _key(name: str) -> RecordKey:
    return RecordKey("tenant-a", "POST /x", name)


class _Stopped:
    """A task that claims `name` in a session, stops the session's server backend (SIGSTOP)
    and leaves the block: its rollback then waits on a server that does not answer."""

    def __init__(self, store: PostgresStore, name: str, acquire_timeout: float) -> None:
        self.backend = 0
        self.stopped = asyncio.Event()
        self.task = asyncio.ensure_future(self._inside(store, name, acquire_timeout))

    async def _inside(self, store: PostgresStore, name: str, acquire_timeout: float) -> None:
        async with store.transaction(acquire_timeout=acquire_timeout) as tx:
            await tx.claim(_key(name), b"f" * 32, retention_seconds=60, wait_seconds=1)
            self.backend = tx.connection.get_server_pid()
            os.kill(self.backend, signal.SIGSTOP)
            self.stopped.set()

    def resume(self) -> None:
        if self.backend:
            os.kill(self.backend, signal.SIGCONT)


@pytest.fixture
async def store(db_dsn: str) -> AsyncIterator[PostgresStore]:
    """A store whose pool has one connection."""
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as one:
        yield one


async def test_a_checkout_with_no_free_connection_gives_up_at_its_deadline(
    store: PostgresStore,
) -> None:
    held = await store.pool.acquire()
    try:

        async def checkout() -> None:
            async with store.transaction(acquire_timeout=DEADLINE):
                raise AssertionError("no connection was free")  # pragma: no cover

        with pytest.raises(StoreError, match="no database connection"):
            await asyncio.wait_for(checkout(), BOUND)  # (TimeoutError: it never gave up)
    finally:
        await store.pool.release(held)
    # The deadline left nothing behind: the next checkout gets the connection.
    async with store.transaction(acquire_timeout=DEADLINE) as tx:
        claim = await tx.claim(_key("after"), b"f" * 32, retention_seconds=60, wait_seconds=1)
        assert isinstance(claim, Claimed)


async def test_a_cancelled_checkout_stays_cancelled(store: PostgresStore) -> None:
    """A cancellation that is not the deadline's (a shutdown) is not turned into a timeout."""
    held = await store.pool.acquire()
    try:

        async def checkout() -> None:
            async with store.transaction(acquire_timeout=BOUND):
                pass  # pragma: no cover

        task = asyncio.ensure_future(checkout())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, BOUND)
    finally:
        await store.pool.release(held)


async def test_a_connection_whose_server_stops_answering_is_terminated_on_its_way_back(
    store: PostgresStore,
) -> None:
    # Leaving the block rolls back, stuck (the server is stopped) until the deadline terminates
    # the connection.
    stopped = _Stopped(store, "stopped", DEADLINE)
    try:
        # (Not wait_for: cancelling a task stuck on a stopped server waits on it too.)
        await asyncio.wait({stopped.task}, timeout=BOUND)
        assert stopped.task.done(), "leaving the block stayed stuck on the stopped server"
    finally:
        stopped.resume()
        await asyncio.wait_for(stopped.task, BOUND)
    # The pool replaced the terminated connection, and the key was never recorded.
    async with store.transaction(acquire_timeout=BOUND) as tx:
        claim = await tx.claim(_key("stopped"), b"f" * 32, retention_seconds=60, wait_seconds=1)
        assert isinstance(claim, Claimed)
        assert tx.connection.get_server_pid() != stopped.backend


async def test_a_deadline_that_fires_once_the_connection_is_back_touches_nothing(
    store: PostgresStore,
) -> None:
    """The timer may fire between the pool taking the connection back and the session hearing
    of it: the session's connection is then a released proxy, and the pool's connection, lent
    to the next checkout, must not be terminated."""
    async with store.transaction(acquire_timeout=BOUND) as done:
        await done.claim(_key("back"), b"f" * 32, retention_seconds=60, wait_seconds=1)
    async with store.transaction(acquire_timeout=BOUND) as tx:
        backend = tx.connection.get_server_pid()
        done.due()  # (what the timer would call)
        claim = await tx.claim(_key("next"), b"f" * 32, retention_seconds=60, wait_seconds=1)
        assert isinstance(claim, Claimed)
        assert tx.connection.get_server_pid() == backend


async def test_a_session_cancelled_on_its_way_back_still_returns_its_connection(
    db_dsn: str,
) -> None:
    """A request cancelled (a shutdown, a client gone) while its session's rollback waits on
    the server: the connection still goes back to the pool, or the pool is one short for good
    (and its close waits for that connection forever)."""
    store = await PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False).open()
    stopped = _Stopped(store, "cancelled", BOUND)
    try:
        try:
            await asyncio.wait_for(stopped.stopped.wait(), BOUND)
            await asyncio.sleep(0.05)  # the block is left: its rollback waits on the server
            stopped.task.cancel()
        finally:
            stopped.resume()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(stopped.task, BOUND)
        # The one connection is back: the next checkout gets it (else it waits out DEADLINE).
        async with store.transaction(acquire_timeout=DEADLINE) as tx:
            claim = await tx.claim(_key("after"), b"f" * 32, retention_seconds=60, wait_seconds=1)
            assert isinstance(claim, Claimed)
    finally:
        store.pool.terminate()  # (a leaked connection would keep a close waiting)
        await store.close()


async def test_the_stores_own_checkouts_give_up_at_its_deadline(db_dsn: str) -> None:
    """Found by probing: lease mode's statements and fences waited for the pool without a bound.
    They wait no longer than the store's bound, which a middleware lowers to its own."""
    async with PostgresStore(
        dsn=db_dsn, min_size=1, max_size=1, listen=False, acquire_timeout=BOUND
    ) as store:
        store.bound_checkouts(DEADLINE)  # what IdempotencyMiddleware(acquire_timeout=0.3) does
        store.bound_checkouts(BOUND)  # a larger bound changes nothing
        held = await store.pool.acquire()
        try:
            with pytest.raises(StoreError, match="no database connection"):
                await asyncio.wait_for(store.get(_key("x")), BOUND)
            with pytest.raises(StoreError, match="no database connection"):
                await asyncio.wait_for(
                    store.claim_lease(_key("x"), b"f" * 32, lease_seconds=5, retention_seconds=60),
                    BOUND,
                )

            async def fence() -> None:
                async with store.fenced(_key("x"), 1):
                    raise AssertionError("no connection was free")  # pragma: no cover

            with pytest.raises(StoreError, match="no database connection"):
                await asyncio.wait_for(fence(), BOUND)
        finally:
            await store.pool.release(held)
        assert await store.get(_key("x")) is None  # the deadlines left nothing behind


async def test_a_lease_request_is_answered_503_at_the_middlewares_deadline(
    db_dsn: str,
) -> None:
    ran: list[int] = []

    async def handler(request: Request) -> Response:
        ran.append(1)
        return JSONResponse({}, status_code=201)

    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
        app = one_route_app(
            "/x",
            handler,
            store=store,
            acquire_timeout=DEADLINE,
            default_policy=Policy(mode=Mode.LEASE),
        )
        held = await store.pool.acquire()
        try:
            async with client(app) as http:
                reply = await asyncio.wait_for(http.post("/x", json={}, headers=key("k")), BOUND)
            assert_problem(reply, 503, "store-unavailable")
        finally:
            await store.pool.release(held)
    assert ran == []


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"])
async def test_a_fresh_claim_the_server_does_not_answer_in_time_is_a_503(
    db_dsn: str, fast_path: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim's statements get the policy's wait as their timeout. A fresh key whose claim
    ran out of it waiting for the server, not for another claim (here the table is locked by
    DDL; behind PgBouncer, no server connection was free) was answered 409 'A request is
    outstanding for this Idempotency-Key' with nothing outstanding. It is 503
    store-unavailable (nothing ran).

    The fast claim was the connection's first message, so it carried the PREPAREs, and was
    cancelled half-way: the claim's was made, the completion's not (it waits for the table).
    The store took them all for made, and every fresh request on that connection then failed
    at its completion ('prepared statement ... does not exist', a 500, its handler's writes
    rolled back). Now that connection's statements are inlined, and the requests are answered;
    the store's other connections keep theirs (it does not stop preparing altogether)."""
    ran: list[int] = []

    async def handler(request: Request) -> Response:
        ran.append(1)
        return JSONResponse({}, status_code=201)

    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False, fast_path=fast_path)
    app = one_route_app("/x", handler, store=store, default_policy=Policy(wait_seconds=0.2))
    keys = [f"late-{fast_path}-{i}" for i in range(3)]
    ddl = await asyncpg.connect(db_dsn)
    try:
        async with store, client(app) as http:
            locking = ddl.transaction()
            await locking.start()
            await ddl.execute("LOCK TABLE idem_requests IN ACCESS EXCLUSIVE MODE")
            try:
                posting = http.post("/x", json={}, headers=key(keys[0]))
                reply = await asyncio.wait_for(posting, BOUND)
            finally:
                await locking.rollback()
            assert_problem(reply, 503, "store-unavailable")
            assert ran == []
            # Found by probing: the wait's TimeoutError (an OSError) was taken for a connection
            # lost in the pool, and the claim made again on another: twice the wait, its
            # transaction left open on the connection given back.
            assert "claiming on another" not in caplog.text
            assert "active transaction" not in caplog.text
            # (One connection: each of these runs on the one the cancelled claim had.)
            again = [await http.post("/x", json={}, headers=key(k)) for k in keys]
    finally:
        await ddl.close()
    assert [r.status_code for r in again] == [201, 201, 201], again[-1].text
    assert ran == [1, 1, 1]
    if fast_path:
        assert store._fast is not None
        assert store._fast.use_prepared  # one doubtful connection inlines, not the store
