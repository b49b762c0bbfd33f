"""The PostgreSQL store's opens and closes as an application's tests meet them: a second close
while the first is closing, a close during an open, opens that nest (a test's fixture and the
app's lifespan), and a store opened in one event loop and used or opened in another."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, PostgresStore, RecordKey, store_lifespan
from idem_middleware.errors import ConfigurationError

BOUND = 10.0


def counting_app(store: PostgresStore, calls: list[int], *, opens: bool = True) -> Starlette:
    async def create(request: Request) -> JSONResponse:
        calls.append(1)
        return JSONResponse({"n": len(calls)}, status_code=201)

    return Starlette(
        routes=[Route("/orders", create, methods=["POST"])],
        lifespan=store_lifespan(store) if opens else None,
        middleware=[
            Middleware(IdempotencyMiddleware, store=store, tenant_resolver=lambda scope: "t")
        ],
    )


async def post(app: Starlette, key: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        return await http.post("/orders", json={"a": 1}, headers={"Idempotency-Key": key})


def in_another_loop(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run `coroutine` in an event loop of its own, in a thread (as another test's loop, or a
    TestClient's, would), and return its result."""
    results: list[Any] = []

    def target() -> None:
        try:
            results.append(asyncio.run(asyncio.wait_for(coroutine, BOUND)))
        except BaseException as exc:
            results.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(BOUND * 2)
    assert not thread.is_alive(), "the other loop's work did not finish"
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


async def test_a_second_close_returns_only_once_the_pool_is_closed(db_dsn: str) -> None:
    """The second of two concurrent closes found no pool (the first had taken it) and returned
    at once, while the first was still closing it: a shutdown that awaited the second went on
    with the pool's connections still open."""
    store = await PostgresStore(dsn=db_dsn, min_size=1, max_size=2).open()
    first = asyncio.ensure_future(store.close())
    second = asyncio.ensure_future(store.close())
    await asyncio.wait_for(second, BOUND)
    assert first.done(), "the second close returned while the first was still closing the pool"
    await first


async def test_a_close_during_an_open_closes_the_pool_the_open_makes(db_dsn: str) -> None:
    """A close while the open was still making the pool found none and did nothing: the open
    then finished, and the store stayed open after its close (its pool never closed)."""
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    opening = asyncio.ensure_future(store.open())
    await asyncio.sleep(0)  # the open is under way: making the pool
    await asyncio.wait_for(store.close(), BOUND)
    await asyncio.wait_for(opening, BOUND)
    assert not store.is_open, "the store's close ran before its open ended, and closed nothing"


async def test_opens_nest_so_a_lifespan_inside_a_fixture_leaves_the_store_open(
    db_dsn: str,
) -> None:
    """A store a test fixture opened, and the app's lifespan opened again: the lifespan's close
    closed it, and every later request (the next test's, with a module-scoped fixture) was a
    503 "the store is closed"."""
    calls: list[int] = []
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    app = counting_app(store, calls)
    async with store:  # the fixture's
        for test in ("first", "second"):
            async with app.router.lifespan_context(app):  # each test's
                assert (await post(app, f"nest-{test}")).status_code == 201
            assert store.is_open
        assert (await post(app, "nest-after")).status_code == 201
    assert not store.is_open
    assert len(calls) == 3


def test_a_store_used_in_another_loop_answers_503_saying_why(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store opened in one event loop (a session-scoped fixture's) and used in another (a
    test's own): asyncpg failed with "attached to a different loop" out of the middleware, a
    500 that named neither loop, and broke the pool's connections. Now the request answers 503
    before a connection is touched, and the log says why and what to do."""
    loop = asyncio.new_event_loop()
    calls: list[int] = []
    try:
        store = loop.run_until_complete(PostgresStore(dsn=db_dsn, min_size=1, max_size=2).open())
        app = counting_app(store, calls)
        with caplog.at_level(logging.WARNING, logger="idem_middleware"):
            response = in_another_loop(post(app, "other-loop"))
        assert response.status_code == 503
        assert response.json()["type"].endswith("store-unavailable")
        assert "belongs to another event loop" in caplog.text
        assert calls == []
        # In its own loop the store still works, and the key was never claimed.
        again = loop.run_until_complete(post(app, "other-loop"))
        assert again.status_code == 201
        assert calls == [1]
        loop.run_until_complete(asyncio.wait_for(store.close(), BOUND))
    finally:
        loop.close()


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_a_store_open_in_one_loop_is_refused_by_a_lifespan_in_another(db_dsn: str) -> None:
    """A store a test fixture opened, given to an app whose lifespan opens it in Starlette's
    TestClient (a loop of its own): the lifespan's open ran the store's checks on the fixture's
    connections ("attached to a different loop"), and its close then took the pool away from
    the fixture without closing it. Now the startup fails, saying why, and the fixture's store
    is left as it was."""
    from starlette.testclient import TestClient

    loop = asyncio.new_event_loop()
    try:
        store = loop.run_until_complete(PostgresStore(dsn=db_dsn, min_size=1, max_size=2).open())
        client = TestClient(counting_app(store, []))
        with pytest.raises(ConfigurationError, match="belongs to another event loop"), client:
            pass
        assert store.is_open
        key = RecordKey("t", "POST /orders", "never-claimed")
        assert loop.run_until_complete(asyncio.wait_for(store.get(key), BOUND)) is None
        loop.run_until_complete(asyncio.wait_for(store.close(), BOUND))
        assert not store.is_open
    finally:
        loop.close()


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_an_app_whose_lifespan_runs_twice_opens_its_store_again(db_dsn: str) -> None:
    """Two `with TestClient(app)` blocks on one app (two tests sharing it): each lifespan opens
    the store in the client's own loop and closes it, and each serves."""
    from starlette.testclient import TestClient

    calls: list[int] = []
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    app = counting_app(store, calls)
    for run in ("first", "second"):
        with TestClient(app) as client:
            response = client.post("/orders", json={}, headers={"Idempotency-Key": f"twice-{run}"})
            assert response.status_code == 201
        assert not store.is_open
    assert len(calls) == 2


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_an_app_started_with_a_store_open_in_another_loop_fails_its_startup(db_dsn: str) -> None:
    """`asyncio.run(store.open())` before the server starts, or a test fixture's store given to
    an app served by TestClient: the startup passed, and every guarded request answered 503.
    The startup now fails, saying why."""
    from starlette.testclient import TestClient

    loop = asyncio.new_event_loop()
    try:
        store = loop.run_until_complete(PostgresStore(dsn=db_dsn, min_size=1, max_size=2).open())
        client = TestClient(counting_app(store, [], opens=False))
        with pytest.raises(ConfigurationError, match="belongs to another event loop"), client:
            pass
        loop.run_until_complete(asyncio.wait_for(store.close(), BOUND))
    finally:
        loop.close()


async def test_a_wait_that_begins_after_the_close_opens_no_listen_connection(db_dsn: str) -> None:
    """A duplicate whose claim read the record just before the store's close, and waited after
    it, made the store's LISTEN connection again, and nothing closed it: on a pool of the app's
    own, a connection never given back (the app's `pool.close()` then waited for it for ever)."""
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    try:
        store = await PostgresStore(pool=pool).open()
        await store.close()
        async with store.watch(RecordKey("t", "POST /orders", "after-close")) as watch:
            assert not await watch.wait(0.01)
            assert store._listener._connecting is None  # no attempt to connect was started
            assert not store._listener.connected()
        # Opened again, it listens again.
        async with store, store.watch(RecordKey("t", "POST /orders", "reopened")):
            assert store._listener._connecting is not None
    finally:
        # (A close cut short terminates the pool.)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(pool.close(), BOUND)


async def test_the_listen_connection_is_made_with_the_stores_connect_kwargs(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store made from a DSN with part of how to connect in `connect_kwargs` (a password, TLS,
    here the server's host and port): its pool connected, but its LISTEN connection was opened
    from the DSN alone, failed, and every duplicate polled ("LISTEN unavailable"). It is now made
    as the pool makes its own connections."""
    from urllib.parse import parse_qs, urlsplit, urlunsplit

    parts = urlsplit(db_dsn)
    query = parse_qs(parts.query)
    where = {
        "host": parts.hostname or query["host"][0],
        "port": parts.port or int(query.get("port", ["5432"])[0]),
    }
    # The DSN names no server: only connect_kwargs says where it is.
    bare = urlunsplit(("postgresql", f"{parts.username}@", parts.path, "", ""))
    try:
        alone = await asyncpg.connect(bare, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        pass
    else:  # a server at the default place: the DSN alone would connect, to another one
        await alone.close()
        pytest.skip("a PostgreSQL server listens where a DSN without a host points")
    store = PostgresStore(dsn=bare, connect_kwargs=where, min_size=1, max_size=2)
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    async with store, store.watch(RecordKey("t", "POST /x", "k")):
        for _ in range(100):  # (the listener connects in a task of its own)
            listening = await store.pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                "idem_middleware.listen",
            )
            if listening or "LISTEN unavailable" in caplog.text:
                break
            await asyncio.sleep(0.05)
    assert listening == 1
    assert "LISTEN unavailable" not in caplog.text


@pytest.mark.parametrize("size", [1, 2])
async def test_a_given_pool_keeps_every_connection_while_the_store_listens(
    db_dsn: str, size: int
) -> None:
    """A store given the app's pool took a connection of that pool for LISTEN, the first time a
    lease-mode duplicate came (a replay was enough), and held it for good: a pool of one then
    answered every guarded request `503 store-unavailable`, and a larger one served one fewer at
    a time than its size. The listener now makes a connection of its own, as the pool makes
    its connections."""
    from idem_middleware import Mode, Policy
    from tests.apps import client, key, one_route_app

    async def pay(request: Request) -> JSONResponse:
        return JSONResponse({"paid": True}, status_code=201)

    pool = await asyncpg.create_pool(db_dsn, min_size=size, max_size=size)
    try:
        async with PostgresStore(pool=pool, acquire_timeout=2) as store:
            policy = Policy(mode=Mode.LEASE, lease_seconds=30, wait_seconds=0.2)
            app = one_route_app("/pay", pay, store=store, default_policy=policy)
            async with client(app) as c:
                first = await c.post("/pay", json={}, headers=key("k1"))
                replay = await c.post("/pay", json={}, headers=key("k1"))
                for _ in range(100):  # (the listener connects in a task of its own)
                    if store._listener.connected():
                        break
                    await asyncio.sleep(0.05)
                assert store._listener.connected()
                after = await c.post("/pay", json={}, headers=key("k2"))
            assert pool.get_idle_size() == size
            listening = await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                "idem_middleware.listen",
            )
    finally:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(pool.close(), BOUND)
    assert (first.status_code, replay.status_code, after.status_code) == (201, 201, 201)
    assert replay.headers["idempotent-replayed"] == "true"
    assert listening == 1
