"""Lease-mode waits registered in `idem_waiters`: a settlement notifies (wakes every listening
process) only when someone waits on the record; the registrations come and go with the waits
(a watch that never waits registers nothing; a cancelled one leaves nothing), and `purge`
removes those a dead process left behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State, StoredResponse
from idem_middleware.store.postgres.rows import NOTIFY_CHANNEL, notify_token

pytestmark = pytest.mark.needs_listen


@pytest.fixture
async def store(db_dsn: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=4) as store:
        await store.pool.execute("TRUNCATE idem_requests, idem_waiters")
        yield store


@pytest.fixture
async def heard(db_dsn: str) -> AsyncIterator[list[str]]:
    """Every notification on the store's channel, as another process's listener hears it."""
    payloads: list[str] = []
    conn = await asyncpg.connect(db_dsn)
    await conn.add_listener(NOTIFY_CHANNEL, lambda *args: payloads.append(args[3]))
    try:
        yield payloads
    finally:
        await conn.close()


async def _claim(store: PostgresStore, key: RecordKey) -> int:
    claim = await store.claim_lease(key, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    return claim.generation


def _done() -> Settlement:
    return Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))


async def _registered(store: PostgresStore, key: RecordKey) -> int:
    n: int = await store.pool.fetchval(
        "SELECT count(*) FROM idem_waiters WHERE token = $1", notify_token(key)
    )
    return n


async def _until(count: Callable[[], Awaitable[int]], expected: int) -> None:
    for _ in range(500):  # bounded: 5 s
        if await count() == expected:
            return
        await asyncio.sleep(0.01)
    assert await count() == expected


async def test_a_settlement_nobody_waits_for_notifies_nobody(
    store: PostgresStore, heard: list[str]
) -> None:
    key = RecordKey("t1", "POST /pay", "unwatched")
    assert await store.settle(key, await _claim(store, key), State.PENDING, _done())
    await asyncio.sleep(0.2)  # (a notification would have arrived by now)
    assert heard == []


async def test_a_fenced_settlement_nobody_waits_for_notifies_nobody(
    store: PostgresStore, heard: list[str]
) -> None:
    """The executor's own path: the settlement in the message that commits its fenced
    transaction (the fast path's `settle_checked`)."""
    key = RecordKey("t1", "POST /pay", "fenced")
    async with store.fenced(key, await _claim(store, key)) as session:
        assert await session.settle(_done())
    record = await store.get(key)
    assert record is not None
    assert record.state is State.SUCCEEDED
    await asyncio.sleep(0.2)
    assert heard == []


async def test_a_settlement_of_a_watched_record_wakes_its_waiter_and_only_its_waiter(
    store: PostgresStore, heard: list[str]
) -> None:
    key, other = RecordKey("t1", "POST /pay", "watched"), RecordKey("t1", "POST /pay", "not")
    generation, bystander = await _claim(store, key), await _claim(store, other)
    async with store.watch(key) as watch:
        for _ in range(500):  # the LISTEN connection comes up in the background
            if watch.listening:
                break
            await asyncio.sleep(0.01)
        assert watch.listening
        assert await _registered(store, key) == 0  # not waiting yet: nothing to notify
        waiting = asyncio.ensure_future(watch.wait(5))
        await _until(lambda: _registered(store, key), 1)
        assert await store.settle(key, generation, State.PENDING, _done())
        assert await store.settle(other, bystander, State.PENDING, _done())
        assert await waiting
    assert await _registered(store, key) == 0  # the wait is over: so is its registration
    await asyncio.sleep(0.1)
    assert heard == [notify_token(key)]


async def test_without_listen_a_wait_registers_nothing(db_dsn: str) -> None:
    key = RecordKey("t1", "POST /pay", "polled")
    async with PostgresStore(dsn=db_dsn, listen=False) as store, store.watch(key) as watch:
        assert not await watch.wait(0.01)
        assert await _registered(store, key) == 0  # it polls: no notification is for it


async def test_a_wait_that_cannot_register_still_waits_by_polling(store: PostgresStore) -> None:
    key = RecordKey("t1", "POST /pay", "unregistered")
    await store.pool.execute("ALTER TABLE idem_waiters RENAME TO idem_waiters_away")
    try:
        async with store.watch(key) as watch:
            assert not await watch.wait(0.05)  # entered, and waits (its caller polls)
    finally:
        await store.pool.execute("ALTER TABLE idem_waiters_away RENAME TO idem_waiters")


async def test_purge_removes_registrations_left_behind_an_hour_ago(store: PostgresStore) -> None:
    await store.pool.execute(
        "INSERT INTO idem_waiters (token, waiter, since) VALUES"
        " ('left-behind', 1, now() - interval '2 hours'), ('current', 2, now())"
    )
    await store.purge()
    left: list[Any] = await store.pool.fetch("SELECT token FROM idem_waiters ORDER BY token")
    assert [r["token"] for r in left] == ["current"]


async def test_a_wait_cancelled_while_it_registers_leaves_no_waiter_behind() -> None:
    """The in-process side of a wait is undone even when its registration never finishes (the
    request was cancelled meanwhile): no event is left for notifications to set."""
    from idem_middleware.store.postgres.listener import Listener

    registering, answer = asyncio.Event(), asyncio.Event()

    async def never_answers(query: str, *args: Any) -> None:
        registering.set()
        await answer.wait()

    async def no_connection() -> Any:
        raise OSError("no server in this test")

    listener = Listener(enabled=True, connect=no_connection, execute=never_answers)

    async def wait() -> None:
        async with listener.watch(RecordKey("t1", "POST /pay", "cancelled")) as watch:
            await watch.wait(5)

    task = asyncio.create_task(wait())
    await asyncio.wait_for(registering.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert listener._waiters == {}
    answer.set()  # (the registration, and its removal, end before the listener closes)
    await listener.close()
    assert listener._pending == set()


class Gated:
    """The store's registration statements, one of them held at a gate: `before` its statement
    runs, or `after` it has committed (a cancellation then arrives as the connection goes back
    to the pool, say)."""

    def __init__(self, store: PostgresStore, verb: str, where: str) -> None:
        self.listener = store._listener
        self.run = self.listener._execute
        self.verb, self.where = verb, where
        self.held, self.gate = asyncio.Event(), asyncio.Event()
        self.statements: list[str] = []
        self.listener._execute = self

    async def __call__(self, query: str, *args: Any) -> Any:
        verb = query.split()[0]
        self.statements.append(verb)
        if verb == self.verb and self.where == "before":
            self.held.set()
            await self.gate.wait()
        result = await self.run(query, *args)
        if verb == self.verb and self.where == "after":
            self.held.set()
            await self.gate.wait()
        return result


@pytest.mark.parametrize(("verb", "where"), [("INSERT", "after"), ("DELETE", "before")])
async def test_a_wait_cancelled_while_it_registers_or_unregisters_leaves_no_row(
    store: PostgresStore, verb: str, where: str
) -> None:
    """A waiter cancelled (its client left, its server shut down) after its INSERT committed but
    before the statement returned never knew its row existed; one cancelled during its DELETE
    never deleted it. Either row stayed behind for an hour (until a purge), notifying each
    settlement of its record: 40 of 300 lease duplicates cancelled at random left one."""
    key = RecordKey("t1", "POST /pay", "cancelled-" + verb + where)
    gated = Gated(store, verb, where)

    async def wait() -> None:
        async with store.watch(key) as watch:
            await watch.wait(0.01 if verb == "DELETE" else 5)

    task = asyncio.create_task(wait())
    await asyncio.wait_for(gated.held.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gated.gate.set()  # the statement goes on (or returns) after the waiter is gone
    await _until(lambda: _registered(store, key), 0)
    assert gated.statements == ["INSERT", "DELETE"]


async def test_a_watch_answered_without_waiting_registers_nothing(store: PostgresStore) -> None:
    """A lease-mode duplicate that finds the outcome (a replay), or runs the handler itself,
    never waits: it registered and unregistered its wait all the same, two statements (two
    connections from the pool) on every replay of a lease-mode request."""
    key = RecordKey("t1", "POST /pay", "replayed")
    gated = Gated(store, "none", "")
    for _ in range(3):
        async with store.watch(key):
            pass
    assert gated.statements == []
