"""Lease renewals waiting for their turn on the renewals' connection go together, in one
statement (queries.sql `heartbeat_batch`, store/postgres/renewals.py), each with its own answer
and its own bound. Real PostgreSQL, directly and through PgBouncer (statement_cache_size=0)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.sql import queries
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State, StoredResponse
from idem_middleware.store.postgres import renewals
from tests.apps import BOUND

pytestmark = pytest.mark.db_routes("pgbouncer")

_Q = queries()


def _key(name: str) -> RecordKey:
    return RecordKey("t", "POST /payouts", name)


async def _claim(store: PostgresStore, name: str) -> int:
    claimed = await store.claim_lease(_key(name), b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claimed, Claimed)
    return claimed.generation


class Counting:
    """The renewals' connection, counting the statements sent on it; while `held` is set, a
    statement waits for it to be cleared before it is sent."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.sent: list[tuple[str, str]] = []
        self.held: asyncio.Event | None = None
        self.waiting = asyncio.Event()

    async def _send(self, method: str, query: str, *args: Any) -> Any:
        self.sent.append((method, query))
        if self.held is not None:
            self.waiting.set()
            await self.held.wait()
        return await getattr(self._conn, method)(query, *args)

    async def fetch(self, query: str, *args: Any) -> Any:
        return await self._send("fetch", query, *args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self._send("fetchval", query, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def _counted(store: PostgresStore, generation: int, name: str) -> Counting:
    """The renewals' connection opened (by a renewal of `name`), then counted."""
    assert await store.heartbeat(_key(name), generation, 30)
    conn = store._renewals._conn
    assert conn is not None
    counting = store._renewals._conn = Counting(conn)
    return counting


async def _leases(pool: asyncpg.Pool[Any]) -> dict[str, Any]:
    rows = await pool.fetch("SELECT idem_key, lease_expires_at FROM idem_requests")
    return {row["idem_key"]: row["lease_expires_at"] for row in rows}


async def test_many_concurrent_renewals_go_in_two_statements(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """200 renewals at once: the first finds the connection free and goes alone; the 199
    arriving while it runs wait, then go in one statement. One at a time, they took 200."""
    names = [f"k{i}" for i in range(200)]
    generations = [await _claim(pg_store, name) for name in names]
    counting = await _counted(pg_store, generations[0], names[0])
    before = await _leases(pool)
    alive = await asyncio.wait_for(
        asyncio.gather(
            *(pg_store.heartbeat(_key(n), g, 30) for n, g in zip(names, generations, strict=True))
        ),
        BOUND,
    )
    assert alive == [True] * 200
    assert counting.sent == [("fetchval", _Q["heartbeat"]), ("fetch", _Q["heartbeat_batch"])]
    after = await _leases(pool)
    assert all(after[name] > before[name] for name in names)


async def test_a_batch_answers_each_renewal_as_the_statement_alone_would(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """In one batch: a pending record renews (twice in it: the longer lease), a stale
    generation and a settled record do not, a record whose row a fence holds is alive without
    being waited for (and left as it is), a lease further off than asked is not shortened, and
    the older and newer generation of one key each get their own answer."""
    store = pg_store
    names = ["first", "live", "settled", "fenced", "far", "taken"]
    g = {name: await _claim(store, name) for name in names}
    settled = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
    assert await store.settle(_key("settled"), g["settled"], State.PENDING, settled)
    await pool.execute(
        "UPDATE idem_requests SET lease_expires_at = now() + interval '1 hour'"
        " WHERE idem_key = 'far'"
    )
    # "taken": its lease lapsed and another execution took it over under a new generation.
    await pool.execute(
        "UPDATE idem_requests SET lease_expires_at = now() - interval '1 s'"
        " WHERE idem_key = 'taken'"
    )
    newer = await store.takeover(_key("taken"), g["taken"], State.PENDING, 30)
    assert newer is not None
    counting = await _counted(store, g["first"], "first")
    before = await _leases(pool)
    async with pool.acquire() as fence, fence.transaction():
        await fence.execute("SELECT FROM idem_requests WHERE idem_key = 'fenced' FOR UPDATE")
        asked = [
            ("first", g["first"], 30),  # (alone: the batch's turn comes after it)
            ("live", g["live"], 30),
            ("live", g["live"], 600),
            ("live", g["live"] + 10_000, 30),  # a generation that never held it
            ("settled", g["settled"], 30),
            ("fenced", g["fenced"], 30),
            ("far", g["far"], 30),
            ("taken", g["taken"], 30),
            ("taken", newer, 30),
            ("nowhere", 1, 30),
        ]
        alive = await asyncio.wait_for(
            asyncio.gather(*(store.heartbeat(_key(n), gen, s) for n, gen, s in asked)), BOUND
        )
        assert alive == [True, True, True, False, False, True, True, False, True, False]
        assert [m for m, _ in counting.sent] == ["fetchval", "fetch"]
        after = await _leases(pool)
    assert after["fenced"] == before["fenced"]  # (locked: left as it was)
    assert after["far"] == before["far"]  # (never shortened)
    assert after["settled"] == before["settled"]
    assert after["taken"] > before["taken"]
    longer = await pool.fetchval(
        "SELECT lease_expires_at - now() > interval '5 minutes' FROM idem_requests"
        " WHERE idem_key = 'live'"
    )
    assert longer  # (the longer of its two renewals)


async def test_a_renewal_whose_bound_passes_in_a_batch_fails_alone(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """A batch's statement held up: the renewal of a short lease in it fails at its own bound
    (StoreError), the renewal of a long one waits on and renews, on the same connection."""
    store = pg_store
    g = {name: await _claim(store, name) for name in ("first", "short", "long")}
    counting = await _counted(store, g["first"], "first")
    counting.held = asyncio.Event()
    first = asyncio.ensure_future(store.heartbeat(_key("first"), g["first"], 30))
    await asyncio.wait_for(counting.waiting.wait(), BOUND)  # (the first, alone, is held)
    short = asyncio.ensure_future(store.heartbeat(_key("short"), g["short"], 3))
    long = asyncio.ensure_future(store.heartbeat(_key("long"), g["long"], 30))
    counting.held.set()  # the first goes through; the batch of two is held in its turn
    counting.held = asyncio.Event()
    counting.waiting.clear()
    assert await asyncio.wait_for(first, BOUND)
    await asyncio.wait_for(counting.waiting.wait(), BOUND)
    with pytest.raises(StoreError, match="took more than 1 s"):
        await asyncio.wait_for(short, BOUND)
    assert not long.done()
    counting.held.set()
    assert await asyncio.wait_for(long, BOUND)
    assert [m for m, _ in counting.sent] == ["fetchval", "fetch"]  # (the two in one batch)
    assert store._renewals._conn is counting  # (kept: its statement was not cancelled)


async def test_waiting_renewals_use_the_pool_while_the_connection_is_still_opening(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """No connection of their own to be had in their turn (its opening hangs): every waiting
    renewal renews on the pool, within its bound."""
    store = pg_store
    names = [f"w{i}" for i in range(20)]
    g = {name: await _claim(store, name) for name in names}
    opened = asyncio.Event()
    connect = store._renewals._connect

    async def slow() -> Any:
        await opened.wait()
        return await connect()

    store._renewals._connect = slow
    try:
        alive = await asyncio.wait_for(
            asyncio.gather(*(store.heartbeat(_key(n), g[n], 3) for n in names)), BOUND
        )
        assert alive == [True] * 20
        assert store._renewals._conn is None
    finally:
        opened.set()
    assert await store.heartbeat(_key(names[0]), g[names[0]], 30)
    assert store._renewals._conn is not None


def test_a_batch_is_bounded() -> None:
    assert renewals.BATCH == 1000


async def test_more_renewals_than_a_batch_take_more_turns(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(renewals, "BATCH", 4)
    names = [f"b{i}" for i in range(10)]
    g = {name: await _claim(pg_store, name) for name in names}
    counting = await _counted(pg_store, g[names[0]], names[0])
    alive = await asyncio.wait_for(
        asyncio.gather(*(pg_store.heartbeat(_key(n), g[n], 30) for n in names)), BOUND
    )
    assert alive == [True] * 10
    # The first alone, then 4, 4 and 1 (alone: the plain statement).
    assert [m for m, _ in counting.sent] == ["fetchval", "fetch", "fetch", "fetchval"]


async def test_a_renewal_the_server_would_refuse_goes_alone_and_fails_alone(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """A lease out of the server's range (here 1e300 s) would have its batch refused and every
    renewal in it failed: it is sent alone, and only it fails."""
    g = {name: await _claim(pg_store, name) for name in ("first", "a", "b")}
    counting = await _counted(pg_store, g["first"], "first")
    answers = await asyncio.wait_for(
        asyncio.gather(
            pg_store.heartbeat(_key("first"), g["first"], 30),
            pg_store.heartbeat(_key("a"), g["a"], 1e300),
            pg_store.heartbeat(_key("a"), g["a"], float("nan")),
            pg_store.heartbeat(_key("b"), g["b"], 30),
            pg_store.heartbeat(_key("first"), g["first"], 30),
            return_exceptions=True,
        ),
        BOUND,
    )
    assert [answers[0], answers[3], answers[4]] == [True, True, True], answers
    assert isinstance(answers[1], asyncpg.PostgresError), answers
    assert [m for m, _ in counting.sent].count("fetch") == 1  # (b and first, together)
