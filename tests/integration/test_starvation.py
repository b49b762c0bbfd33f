"""Nobody starves: no lock, transaction or pooled connection is held while a request talks to its
client or waits for another request. Real PostgreSQL, small pools, no wall-clock assertions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import Policy, PostgresStore
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    Held,
    Leaves,
    NeverReads,
    Step,
    asgi_request,
    assert_problem,
    assert_replay_of,
    build_app,
    build_lease_app,
    client,
    idempotency_middleware,
    idle_in_transaction,
    key,
    reset_downstream,
    until,
    wait_entered,
    wait_for_waiters,
)

CREDIT = "/accounts/acc-1/credits"
BODY = {"amount": 5}


@pytest.fixture
async def small_store(db_dsn: str, pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    """A store with a pool of 3 connections (the `pool` fixture empties the tables)."""
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=3) as store:
        yield store


async def test_duplicates_of_a_slow_request_wait_without_taking_the_pool(
    small_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """A slow handler is held; 20 duplicates of it wait; another tenant's requests, on the same
    pool of 3, complete while the slow handler is still held."""
    app = build_app(small_store, default_policy=Policy(wait_seconds=60), acquire_timeout=2)
    probe = app.state.probe
    async with client(app) as a, client(app, token="demo-b") as b, Held(probe) as held:
        first = held.start(a.post(CREDIT, json=BODY, headers=key("slow")))
        await wait_entered(probe)
        duplicates = [held.start(a.post(CREDIT, json=BODY, headers=key("slow"))) for _ in range(20)]
        await wait_for_waiters(app, 20)
        for i in range(5):
            other = await asyncio.wait_for(b.post("/items", json=BODY, headers=key(f"b{i}")), BOUND)
            assert other.status_code == 201, other.text
        assert not first.done(), "the slow handler must still be held"
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
        replies = await asyncio.wait_for(asyncio.gather(*duplicates), BOUND)
    assert r1.status_code == 201
    for reply in replies:
        assert_replay_of(reply, r1)
    assert probe.calls == 1 + 5  # the slow credit once, and the other tenant's items


def _scope(path: str, idem_key: str, token: str = "demo-a") -> dict[str, Any]:
    route, _, query = path.partition("?")
    return asgi_request(route, f'"{idem_key}"', 2, token=token, query=query.encode())


@pytest.mark.parametrize("path", ["/stream", "/big?size=50000"])
async def test_clients_that_never_read_a_stream_hold_no_connection(
    small_store: PostgresStore, pool: asyncpg.Pool[Any], path: str
) -> None:
    """4 clients post fresh keys to a response that cannot be held and never read it: the pool
    of 3 still serves another tenant, and none of our connections sits idle in transaction."""
    app = build_app(
        small_store, default_policy=Policy(max_response_bytes=10_000), acquire_timeout=2
    )
    stuck = [NeverReads() for _ in range(4)]
    tasks = [
        asyncio.ensure_future(app(_scope(path, f"stuck-{i}"), c.receive, c.send))
        for i, c in enumerate(stuck)
    ]
    try:
        for c in stuck:
            await asyncio.wait_for(c.started.wait(), BOUND)
        async with client(app, token="demo-b") as b:
            for i in range(3):
                other = await asyncio.wait_for(
                    b.post("/items", json=BODY, headers=key(f"b{i}")), BOUND
                )
                assert other.status_code == 201, other.text
        assert await idle_in_transaction(pool) == 0
        assert not any(t.done() for t in tasks), "the streams must still be stuck"
        # Each stuck stream's outcome was settled before its first byte.
        settled = await pool.fetchval(
            "SELECT count(*) FROM idem_requests WHERE idem_key LIKE 'stuck-%' AND body_omitted"
            " IS NOT NULL"
        )
        assert settled == 4
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_past_the_waiter_bound_a_duplicate_is_answered_at_once(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    app = build_app(pg_store, default_policy=Policy(wait_seconds=60), max_waiters=2)
    probe = app.state.probe
    async with client(app) as a, Held(probe) as held:
        first = held.start(a.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        waiting = [held.start(a.post(CREDIT, json=BODY, headers=key("k1"))) for _ in range(2)]
        await wait_for_waiters(app, 2)
        third = await asyncio.wait_for(a.post(CREDIT, json=BODY, headers=key("k1")), BOUND)
        assert_problem(third, 409, "request-in-flight")
        assert third.headers["retry-after"] == "1"
        assert not first.done()
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
        for reply in await asyncio.wait_for(asyncio.gather(*waiting), BOUND):
            assert_replay_of(reply, r1)
    assert probe.calls == 1


async def _leave_while_waiting(app: Any, path: str, body: bytes) -> None:
    """A duplicate (key "k1") of the request held on `path` waits; its client leaves. Its waiting
    place is free again at once, its request ends quietly, and it was sent nothing."""
    waiters = idempotency_middleware(app).waiters
    leaving = Leaves(body)
    scope = asgi_request(path, '"k1"', len(body))
    gone = asyncio.ensure_future(app(scope, leaving.receive, leaving.send))
    try:
        await wait_for_waiters(app, 1)
        leaving.leave()
        await until(lambda: waiters.count == 0)
        await asyncio.wait_for(gone, BOUND)
    finally:
        gone.cancel()
    assert leaving.sent == []


async def test_a_duplicate_whose_client_leaves_stops_waiting(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """Transactional mode: a waiting duplicate whose client disconnects gives its waiting place
    back at once (not when its minute of waiting runs out), and is sent nothing; the place then
    serves the next duplicate, which gets the replay."""
    app = build_app(pg_store, default_policy=Policy(wait_seconds=60), max_waiters=1)
    probe = app.state.probe
    async with client(app) as a, Held(probe) as held:
        first = held.start(a.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        await _leave_while_waiting(app, CREDIT, b'{"amount": 5}')
        second = held.start(a.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_for_waiters(app, 1)  # not "409: too many waiting"
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
        assert_replay_of(await asyncio.wait_for(second, BOUND), r1)
    assert probe.calls == 1


async def test_a_lease_duplicate_whose_client_leaves_stops_waiting(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """Lease mode: the same, for a duplicate waiting on a record another request executes."""
    await reset_downstream(pool)
    policy = Policy(mode=LEASE_POLICY.mode, lease_seconds=5.0, wait_seconds=60)
    app = build_lease_app(pg_store, pool, policy, max_waiters=1)
    gate = asyncio.Event()
    app.state.probe.steps = [Step(gate=gate)]
    payout = {"account": "acc-1", "amount": 100}
    async with client(app) as a:
        first = asyncio.ensure_future(a.post(PAYOUTS, json=payout, headers=key("k1")))
        try:
            await asyncio.wait_for(app.state.probe.entered.wait(), BOUND)
            await _leave_while_waiting(app, PAYOUTS, b'{"account": "acc-1", "amount": 100}')
            second = asyncio.ensure_future(a.post(PAYOUTS, json=payout, headers=key("k1")))
            await wait_for_waiters(app, 1)
            gate.set()
            r1 = await asyncio.wait_for(first, BOUND)
            assert r1.status_code == 201, r1.text
            assert_replay_of(await asyncio.wait_for(second, BOUND), r1)
        finally:
            gate.set()
            await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), BOUND)
    assert app.state.probe.calls == 1


class CancelMeansGone:
    """A client as gunicorn's ASGI worker (`-k asgi`) presents it: once a receive() waiting for
    the disconnect after the body is cancelled, every later receive() says the client left."""

    def __init__(self, body: bytes) -> None:
        self._body: bytes | None = body
        self.cancelled = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        body, self._body = self._body, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        if self.cancelled:
            return {"type": "http.disconnect"}
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled += 1
        raise AssertionError("unreachable")  # pragma: no cover

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_a_duplicate_is_answered_where_a_cancelled_receive_means_the_client_left(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any], mode: str
) -> None:
    """A waiting duplicate watches its client each round of its wait. Each round cancelled its
    own receive(), so under gunicorn's ASGI worker the second round saw the client gone: the
    duplicate ended with nothing sent (gunicorn answered its plain-text 500). One receive() now
    watches for the whole request: the duplicate gets the replay."""
    gate = asyncio.Event()
    if mode == "transactional":
        app = build_app(pg_store, default_policy=Policy(wait_seconds=60))
        app.state.probe.gate = gate
        path, payload = CREDIT, BODY
    else:
        await reset_downstream(pool)
        policy = Policy(mode=LEASE_POLICY.mode, lease_seconds=5.0, wait_seconds=60)
        app = build_lease_app(pg_store, pool, policy)
        app.state.probe.steps = [Step(gate=gate)]
        path, payload = PAYOUTS, {"account": "acc-1", "amount": 100}
    body = json.dumps(payload).encode()
    duplicate = CancelMeansGone(body)
    async with client(app) as a:
        first = asyncio.ensure_future(a.post(path, json=payload, headers=key("k1")))
        try:
            await asyncio.wait_for(app.state.probe.entered.wait(), BOUND)
            scope = asgi_request(path, '"k1"', len(body))
            waiting = asyncio.ensure_future(app(scope, duplicate.receive, duplicate.send))
            await wait_for_waiters(app, 1)
            # Several rounds of its wait (polls of 20 or 50 ms, doubling): a watch that read its
            # own receive() each round was cancelled at each round's end.
            await asyncio.sleep(1.0)
            gate.set()
            r1 = await asyncio.wait_for(first, BOUND)
            await asyncio.wait_for(waiting, BOUND)
        finally:
            gate.set()
            await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), BOUND)
    assert r1.status_code == 201, r1.text
    start = duplicate.sent[0] if duplicate.sent else {}
    assert start.get("status") == 201, duplicate.sent
    assert (b"idempotent-replayed", b"true") in start["headers"]
    assert b"".join(m.get("body", b"") for m in duplicate.sent[1:]) == r1.content
    assert app.state.probe.calls == 1


async def test_past_the_tenant_cap_a_request_is_refused_with_nothing_claimed(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    app = build_app(pg_store, max_tenant_connections=1)
    probe = app.state.probe
    async with client(app) as a, client(app, token="demo-b") as b, Held(probe) as held:
        first = held.start(a.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        refused = await asyncio.wait_for(a.post("/items", json=BODY, headers=key("k2")), BOUND)
        problem = assert_problem(refused, 429, "tenant-busy")
        assert refused.headers["retry-after"] == "1"
        assert "at once" in problem["detail"]
        other = await asyncio.wait_for(b.post("/items", json=BODY, headers=key("k2")), BOUND)
        assert other.status_code == 201, "another tenant is not capped by this one"
        held.release()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
        # Nothing was claimed for the refused request: the same key runs now.
        again = await a.post("/items", json=BODY, headers=key("k2"))
        assert again.status_code == 201
        assert "idempotent-replayed" not in again.headers
    assert probe.calls == 3
    keys = await pool.fetch("SELECT tenant, idem_key FROM idem_requests ORDER BY 1, 2")
    assert [(r["tenant"], r["idem_key"]) for r in keys] == [
        ("tenant-a", "k1"),
        ("tenant-a", "k2"),
        ("tenant-b", "k2"),
    ]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3"])
def test_the_tenant_cap_must_be_a_positive_whole_number(pg_store: PostgresStore, bad: Any) -> None:
    from idem_middleware import ConfigurationError, IdempotencyMiddleware

    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(lambda *a: None, store=pg_store, max_tenant_connections=bad)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_the_waiter_bound_must_be_a_whole_number(pg_store: PostgresStore, bad: Any) -> None:
    from idem_middleware import ConfigurationError, IdempotencyMiddleware

    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(lambda *a: None, store=pg_store, max_waiters=bad)


async def test_with_the_pool_taken_a_request_is_refused_after_the_acquire_timeout(
    small_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """Every connection of the store's pool is held elsewhere: a request waits at most
    `acquire_timeout` for one, is answered 503 with nothing claimed and its handler never run,
    and the same key succeeds once a connection is free (the wait wedged nothing)."""
    app = build_app(small_store, acquire_timeout=0.3)
    probe = app.state.probe
    taken = [await small_store.pool.acquire() for _ in range(3)]
    try:
        async with client(app) as c:
            r = await asyncio.wait_for(c.post(CREDIT, json=BODY, headers=key("pool-1")), BOUND)
            assert_problem(r, 503, "store-unavailable")
            assert probe.calls == 0
            assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 0
            for conn in taken:
                await small_store.pool.release(conn)
            taken = []
            r = await asyncio.wait_for(c.post(CREDIT, json=BODY, headers=key("pool-1")), BOUND)
            assert r.status_code == 201, r.text
            assert probe.calls == 1
    finally:
        for conn in taken:
            await small_store.pool.release(conn)
