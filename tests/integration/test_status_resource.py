"""The status resource: keys checked as the header is, one read-only SELECT, and an answer only
from the caller's own record, or its own uncommitted claim (the key's claim lock)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast
from urllib.parse import unquote

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Host, Mount, Route, Router

from idem_middleware import (
    IdempotencyMiddleware,
    LeaseExpiry,
    MemoryStore,
    Mode,
    Policy,
    PostgresStore,
    idempotent,
)
from idem_middleware.errors import StoreError
from idem_middleware.status import status_route
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State, StoredResponse
from idem_middleware.tokens import TokenIssuer, token_route
from tests.apps import (
    BOUND,
    BearerBackend,
    Held,
    QueryLog,
    assert_problem,
    build_app,
    client,
    key,
    logged_pool,
    wait_entered,
)

CREDIT = "/accounts/a1/credits"
CREDIT_OP = "POST /accounts/{account_id}/credits"
STATUS = "/idempotency/status"
FINISHED = "The request has finished: send it again with the same key for its response."


@pytest.fixture
async def logged(db_dsn: str) -> Any:
    log = QueryLog()
    async with logged_pool(db_dsn, log) as pool:
        yield pool, log


@pytest.mark.parametrize(
    "query",
    [
        pytest.param(f"operation={CREDIT_OP}&key=" + "k" * 256, id="key-over-255"),
        pytest.param(f"operation={CREDIT_OP}&key=a%00b", id="key-with-nul"),
        pytest.param(f"operation={CREDIT_OP}&key=caf%C3%A9", id="key-not-ascii"),
        pytest.param(f"operation={CREDIT_OP}&key=a%0Ab", id="key-with-newline"),
        pytest.param("operation=POST%20/x%00&key=k", id="operation-with-nul"),
        pytest.param("operation=payouts&key=k", id="operation-not-method-and-path"),
        pytest.param("operation=POST%20/" + "x" * 3000 + "&key=k", id="operation-too-long"),
        pytest.param(f"operation={CREDIT_OP}", id="no-key"),
        pytest.param(f"operation={CREDIT_OP}&key=", id="empty-key"),
        pytest.param("key=k", id="no-operation"),
    ],
)
async def test_a_bad_key_or_operation_is_a_400_problem(logged: Any, query: str) -> None:
    pool, log = logged
    store = PostgresStore(pool=pool)
    await store.check_given_pool()  # (the startup's checks of a pool given: not this test's)
    log.queries.clear()
    app = build_app(store)
    async with client(app) as c:
        r = await c.get(f"{STATUS}?{query}")
    # (No key at all is `missing-key`, as on a guarded route; any other refusal `invalid-key`.)
    missing = "key=" not in query or query.endswith("key=")
    assert_problem(r, 400, "missing-key" if missing else "invalid-key")
    assert log.queries == []  # refused before any query


async def test_the_longest_key_the_header_allows_is_looked_up(logged: Any) -> None:
    pool, _ = logged
    app = build_app(PostgresStore(pool=pool))
    long_key = "k" * 255
    async with client(app) as c:
        await c.post(CREDIT, json={"amount": 5}, headers=key(long_key))
        r = await c.get(STATUS, params={"operation": CREDIT_OP, "key": long_key})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "operation": CREDIT_OP,
        "state": "succeeded",
        "response_status": 201,
        "retry": False,
        "detail": FINISHED,
    }


async def test_a_probe_is_one_select_and_writes_nothing(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool))
    before = await _inserts(pool)
    async with client(app) as c:
        # (The first reads the claim lock's secret, once for the store: see claim_lock.py.)
        await c.get(STATUS, params={"operation": CREDIT_OP, "key": "first"})
        log.queries.clear()
        r = await c.get(STATUS, params={"operation": CREDIT_OP, "key": "unknown"})
    assert_problem(r, 404, "record-not-found")
    # One SELECT of the record (then the borrowed pool's own reset): no BEGIN, INSERT, ROLLBACK.
    [query] = [
        q
        for q in log.queries
        if q != "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;"
    ]
    assert query.startswith("SELECT ")
    assert "FROM idem_requests WHERE" in query
    assert await _inserts(pool) == before


async def _inserts(pool: Any) -> int:
    """Row versions ever inserted into idem_requests (committed or rolled back)."""
    await pool.execute("SELECT pg_stat_force_next_flush()")
    n: int = await pool.fetchval(
        "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'idem_requests'"
    )
    return n


async def test_a_held_claim_lock_is_read_as_running_for_its_own_tenant_only(logged: Any) -> None:
    """A transaction holding tenant b's claim lock of a key (as a transactional claim does until
    it commits) makes that key `pending` for tenant b, and for nobody else: tenant a's status
    of the same operation and key stays 404 (its lock is another value)."""
    pool, _ = logged
    app = build_app(PostgresStore(pool=pool))
    params = {"operation": CREDIT_OP, "key": "mine"}
    async with pool.acquire() as holder, holder.transaction():
        # Exactly the lock a claim of tenant b's key takes.
        await holder.fetch("SELECT * FROM idem_claim_key('tenant-b', $1, 'mine')", CREDIT_OP)
        async with client(app, token="demo-b") as b, client(app) as a:
            theirs = await a.get(STATUS, params=params)
            ours = await b.get(STATUS, params=params)
    async with client(app, token="demo-b") as b:
        after = await b.get(STATUS, params=params)
    assert_problem(theirs, 404, "record-not-found")
    assert ours.status_code == 200
    assert ours.json()["state"] == "pending"
    assert_problem(after, 404, "record-not-found")  # the lock's transaction ended: nothing ran


@pytest.mark.parametrize("memory", [False, True], ids=["postgres", "memory"])
async def test_a_running_transactional_request_is_pending_not_404(
    logged: Any, memory: bool
) -> None:
    """Found by probing: a transactional request still running was `404 record-not-found` here
    (its claim is uncommitted, its record written only at commit), so a client that got a 202
    and followed its Location was told no such request exists. It is now `pending`, `"retry":
    false`, with the route's Retry-After, as a running lease-mode request is; then its outcome."""
    pool, _ = logged
    store: Any = MemoryStore() if memory else PostgresStore(pool=pool)
    policy = Policy(wait_seconds=0.05, accept_while_in_flight=True, retry_after_seconds=3)
    app = build_app(store, default_policy=policy)
    probe = app.state.probe
    body = {"amount": 5}
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json=body, headers=key("running")))
        await wait_entered(probe)
        accepted = await c.post(CREDIT, json=body, headers=key("running"))
        running = await c.get(accepted.headers["location"])
        held.release()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
        done = await c.get(accepted.headers["location"])
    assert accepted.status_code == 202
    assert running.status_code == 200
    assert running.json() == {
        "operation": CREDIT_OP,
        "state": "pending",
        "response_status": None,
        "retry": False,
        "detail": "The request is running: ask again later, or send it again with the same key.",
    }
    assert running.headers["retry-after"] == "3"
    assert running.headers["cache-control"] == "no-store"
    assert done.json()["state"] == "succeeded"
    assert done.json()["response_status"] == 201
    assert "retry-after" not in done.headers


async def test_another_tenants_committed_record_is_not_found(logged: Any) -> None:
    pool, _ = logged
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as a, client(app, token="demo-b") as b:
        await a.post(CREDIT, json={"amount": 5}, headers=key("shared"))
        theirs = await b.get(STATUS, params={"operation": CREDIT_OP, "key": "shared"})
        ours = await a.get(STATUS, params={"operation": CREDIT_OP, "key": "shared"})
    assert_problem(theirs, 404, "record-not-found")
    assert ours.json()["state"] == "succeeded"


async def test_an_operation_under_a_host_route_is_looked_up(logged: Any) -> None:
    """Found by probing: a Host route's operation (`POST api.example/pay`, as a 202's Location
    names it) was refused as not `METHOD /template`."""

    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    pool, _ = logged
    store = PostgresStore(pool=pool)
    app = Starlette(
        routes=[
            Host("api.example", app=Router([Route("/pay", pay, methods=["POST"])])),
            status_route(store),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )
    async with client(app) as c:
        made = await c.post("http://api.example/pay", json={}, headers=key("on-a-host"))
        assert made.status_code == 201, made.text
        operation = "POST api.example/pay"
        r = await c.get(STATUS, params={"operation": operation, "key": "on-a-host"})
        assert r.status_code == 200, r.text
        assert r.json() == {
            "operation": operation,
            "state": "succeeded",
            "response_status": 201,
            "retry": False,
            "detail": FINISHED,
        }
        for refused in ("POST api.example", "POST a b/pay", "post /pay"):
            bad = await c.get(STATUS, params={"operation": refused, "key": "on-a-host"})
            assert_problem(bad, 400, "invalid-key")


async def test_no_answer_of_the_status_resource_may_be_cached(logged: Any) -> None:
    """Found by probing: its answers carried no Cache-Control, so a cache could keep the 404 of
    a request that had not committed yet (a 404 is heuristically cacheable, as a 200 is) and
    answer every later poll with it, or keep a `pending` past the outcome."""
    pool, _ = logged
    app = build_app(PostgresStore(pool=pool))
    params = {"operation": CREDIT_OP, "key": "polled"}
    async with client(app) as c:
        missing = await c.get(STATUS, params=params)
        await c.post(CREDIT, json={"amount": 5}, headers=key("polled"))
        found = await c.get(STATUS, params=params)
        bad = await c.get(STATUS, params={"operation": "payouts", "key": "polled"})
    async with client(app, token=None) as anonymous:
        unauthenticated = await anonymous.get(STATUS, params=params)
    assert_problem(missing, 404, "record-not-found")
    assert found.json()["state"] == "succeeded"
    assert_problem(bad, 400, "invalid-key")
    assert_problem(unauthenticated, 401, "unauthenticated")
    for answer in (missing, found, bad, unauthenticated):
        assert answer.headers.get_list("cache-control") == ["no-store"]


class Unreachable:
    async def peek(self, key: Any) -> Any:
        raise StoreError("no database connection: ConnectionRefusedError")


async def test_an_unreachable_store_is_a_503_to_retry_not_a_server_error() -> None:
    """Found by probing: the store's error went out as a bare `500 Internal Server Error`
    (text/plain), where the guarded routes answer `503 store-unavailable` + Retry-After."""
    app = Starlette(
        routes=[status_route(cast(Any, Unreachable()))],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )
    async with client(app) as c:
        r = await c.get(STATUS, params={"operation": CREDIT_OP, "key": "k"})
    assert_problem(r, 503, "store-unavailable")
    assert r.headers["retry-after"] == "1"
    assert r.headers["cache-control"] == "no-store"


async def test_a_pending_request_only_a_retry_can_move_says_so(
    pg_store: PostgresStore, pool: Any
) -> None:
    """Found by probing: a lease-mode request whose executor died (its lease lapsed), or that a
    reconciler or an operator released for a retry, read `pending` like one still running, and
    only the client's own retry moves either: a client polling the 202's Location for a change
    polled for good. It now reads `"retry": true`."""
    store = pg_store
    op = "POST /payouts"

    async def claim(name: str) -> int:
        claimed = await store.claim_lease(
            RecordKey("tenant-a", op, name), b"fp", retention_seconds=60.0, lease_seconds=30.0
        )
        assert isinstance(claimed, Claimed)
        return claimed.generation

    await claim("running")
    await claim("lapsed")
    await pool.execute(
        "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
        " WHERE idem_key = 'lapsed'"
    )
    released = await claim("released")
    key = RecordKey("tenant-a", op, "released")
    assert await store.settle(key, released, State.PENDING, Settlement(State.UNKNOWN, None))
    assert await store.allow_retry(key, released, "the bank has no such payout")
    app = build_app(store)
    async with client(app) as c:
        answers = {
            name: await c.get(STATUS, params={"operation": op, "key": name})
            for name in ("running", "lapsed", "released")
        }
    seen = {name: answer.json() for name, answer in answers.items()}
    assert {name: (body["state"], body["retry"]) for name, body in seen.items()} == {
        "running": ("pending", False),
        "lapsed": ("pending", True),
        "released": ("pending", True),
    }
    # Only a request still running says when to ask again.
    after = {name: answer.headers.get("retry-after") for name, answer in answers.items()}
    assert after == {"running": "1", "lapsed": None, "released": None}


async def test_an_unknown_outcome_says_whether_a_retry_can_settle_it(
    pg_store: PostgresStore, pool: Any
) -> None:
    """Found by probing: an `unknown` request read `"retry": false` whether or not its route
    has a reconciler, and said nothing of what to do. With one, the client's retry with the same
    key is exactly what settles it (the reconciler asks the other system); without one, only an
    operator can, and a client told nothing may well send it again under a new key. The answer
    now says which (`retry`), and `detail` says what to do."""

    async def reconcile(ctx: Any) -> Any:
        raise AssertionError("a status read never reconciles")

    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    store, lease = pg_store, {"mode": Mode.LEASE}
    app = Starlette(
        routes=[
            Route("/payouts", idempotent(**lease, reconciler=reconcile)(pay), methods=["POST"]),
            Route("/refunds", idempotent(**lease)(pay), methods=["POST"]),
            status_route(store),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )
    for op in ("POST /payouts", "POST /refunds", "POST /elsewhere"):
        lost = RecordKey("tenant-a", op, "lost")
        claimed = await store.claim_lease(lost, b"fp", retention_seconds=60.0, lease_seconds=30.0)
        assert isinstance(claimed, Claimed)
        settled = Settlement(State.UNKNOWN, None)
        assert await store.settle(lost, claimed.generation, State.PENDING, settled)
    async with client(app) as c:
        seen = {
            op: (await c.get(STATUS, params={"operation": op, "key": "lost"})).json()
            for op in ("POST /payouts", "POST /refunds", "POST /elsewhere")
        }
    assert {op: (body["state"], body["retry"]) for op, body in seen.items()} == {
        "POST /payouts": ("unknown", True),
        "POST /refunds": ("unknown", False),
        "POST /elsewhere": ("unknown", False),  # no route of this app: nothing known of it
    }
    assert "asks the system it called" in seen["POST /payouts"]["detail"]
    assert "an operator resolves it" in seen["POST /refunds"]["detail"]
    assert "Never send it under a new key" in seen["POST /refunds"]["detail"]
    assert "where the operation can ask" in seen["POST /elsewhere"]["detail"]
    assert await pool.fetchval("SELECT count(*) FROM idem_requests WHERE state = 'unknown'") == 3


async def test_the_key_may_come_in_the_idempotency_key_header(logged: Any) -> None:
    """A token route's 202 leaves the token out of its Location; the client sends it as it sent
    the request. The query's key and the header's must then agree."""
    pool, _ = logged
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as c:
        await c.post(CREDIT, json={"amount": 5}, headers=key("in-a-header"))
        found = await c.get(STATUS, params={"operation": CREDIT_OP}, headers=key("in-a-header"))
        both = await c.get(
            STATUS,
            params={"operation": CREDIT_OP, "key": "in-a-header"},
            headers=key("in-a-header"),
        )
        differ = await c.get(
            STATUS, params={"operation": CREDIT_OP, "key": "other"}, headers=key("in-a-header")
        )
        bad = await c.get(STATUS, params={"operation": CREDIT_OP}, headers=key(""))
    assert found.status_code == both.status_code == 200, found.text
    assert found.json()["state"] == "succeeded"
    assert "differ" in assert_problem(differ, 400, "invalid-key")["detail"]
    assert_problem(bad, 400, "invalid-key")


async def test_every_answer_is_true_of_the_routes_policy_as_it_is_now(
    pg_store: PostgresStore, pool: Any
) -> None:
    """Found by probing: a lapsed lease under a route now transactional (a rolling deploy moved
    it) read `"retry": true` and "send it again", but a transactional retry answered `409
    request-in-flight` for good; and a lapsed lease with no way to learn its outcome read the
    same as one the retry takes over. Each (state, route policy) now says what the retry does."""

    async def reconcile(ctx: Any) -> Any:
        raise AssertionError("a status read never reconciles")

    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    lease = {"mode": Mode.LEASE}
    routes = {
        "/transactional": idempotent()(pay),
        "/no-reconciler": idempotent(**lease)(pay),
        "/reconciler": idempotent(**lease, reconciler=reconcile)(pay),
        "/takeover": idempotent(**lease, on_lease_expiry=LeaseExpiry.TAKEOVER)(pay),
    }
    store = pg_store
    app = Starlette(
        routes=[*(Route(p, f, methods=["POST"]) for p, f in routes.items()), status_route(store)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )
    for path in routes:
        for name in ("running", "lapsed", "released", "unknown", "done"):
            k = RecordKey("tenant-a", f"POST {path}", name)
            claimed = await store.claim_lease(k, b"fp", retention_seconds=60, lease_seconds=30)
            assert isinstance(claimed, Claimed)
            g = claimed.generation
            if name in ("released", "unknown"):
                assert await store.settle(k, g, State.PENDING, Settlement(State.UNKNOWN))
            if name == "released":
                assert await store.allow_retry(k, g, "not at the bank")
            if name == "done":
                done = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
                assert await store.settle(k, g, State.PENDING, done)
    await pool.execute(
        "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
        " WHERE idem_key = 'lapsed'"
    )
    async with client(app) as c:
        seen = {
            (path, name): (
                await c.get(STATUS, params={"operation": f"POST {path}", "key": name})
            ).json()
            for path in routes
            for name in ("running", "lapsed", "released", "unknown", "done")
        }
    told = {at: (body["retry"], body["detail"]) for at, body in seen.items()}
    for path in routes:
        assert told[path, "running"] == (
            False,
            "The request is running: ask again later, or send it again with the same key.",
        )
        assert told[path, "released"][0] is True
        assert told[path, "done"] == (False, FINISHED)
    lapsed = {path: told[path, "lapsed"] for path in routes}
    assert all(retry for retry, _ in lapsed.values())  # each retry moves it
    assert "to run it" in lapsed["/takeover"][1]
    # (Not "nothing runs it": a lease lapses under a handler whose own fenced transaction holds
    # the record too, and that one finishes.)
    assert all("may have stopped" in said for _, said in lapsed.values())
    assert "asks the system it called" in lapsed["/reconciler"][1]
    for path in ("/transactional", "/no-reconciler"):
        assert "409 outcome-unknown until an operator resolves it" in lapsed[path][1]
        assert "Never send it under a new key" in lapsed[path][1]
    unknown = {path: told[path, "unknown"] for path in routes}
    assert unknown["/reconciler"][0] is True
    for path in ("/transactional", "/no-reconciler", "/takeover"):
        assert unknown[path][0] is False
        assert "an operator resolves it" in unknown[path][1]


async def test_a_repeated_key_or_operation_is_a_400_not_the_last_one_looked_up(
    logged: Any,
) -> None:
    """Found by probing: `?key=a&key=b` answered with b's record (the last one read), so a
    client (or a proxy that appends a parameter) could be told of another request than its own."""
    pool, log = logged
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as c:
        await c.post(CREDIT, json={"amount": 5}, headers=key("b"))
        log.queries.clear()
        for query in (
            f"operation={CREDIT_OP}&key=a&key=b",
            f"operation=POST%20/x&operation={CREDIT_OP}&key=b",
        ):
            r = await c.get(f"{STATUS}?{query}")
            assert "once each" in assert_problem(r, 400, "invalid-key")["detail"]
    assert log.queries == []  # refused before any query


@pytest.mark.parametrize("tenant", ["a\x00b", "\ud800"], ids=["nul", "lone-surrogate"])
async def test_a_tenant_the_store_cannot_hold_is_a_misconfiguration_problem(
    logged: Any, tenant: str
) -> None:
    """Found by probing: a tenant resolver answering a str PostgreSQL text cannot hold made the
    status resource a bare `500 Internal Server Error` (text/plain, the driver's error), and the
    token route a `400 body-invalid` that blamed the client's body. Both now answer the server's
    `500 server-misconfigured` problem, on either store."""
    pool, log = logged
    issuer = TokenIssuer(PostgresStore(pool=pool), secret=b"s" * 32)
    store = PostgresStore(pool=pool)
    app = Starlette(
        routes=[
            status_route(store, tenant_resolver=lambda scope: tenant),
            token_route(issuer, tenant_resolver=lambda scope: tenant),
        ]
    )
    async with client(app) as c:
        status = await c.get(STATUS, params={"operation": CREDIT_OP, "key": "k"})
        token = await c.post("/idempotency/tokens", json={"operation": CREDIT_OP})
    assert_problem(status, 500, "server-misconfigured")
    assert_problem(token, 500, "server-misconfigured")
    assert log.queries == []


async def test_an_anonymous_duplicate_in_flight_is_a_409_not_a_202_it_cannot_follow() -> None:
    """Found by probing: on an `allow_anonymous` route with `accept_while_in_flight`, an
    anonymous caller's duplicate got `202` + a Location the status resource answers only with
    `401` (it serves authenticated callers: anonymous callers share one key space). It now gets
    `409 request-in-flight` + Retry-After, whose retry with the same key is its way forward."""
    policy = Policy(
        allow_anonymous=True, accept_while_in_flight=True, wait_seconds=0.05, retry_after_seconds=2
    )
    app = build_app(MemoryStore(), default_policy=policy)
    probe = app.state.probe
    body = {"amount": 5}
    async with client(app, token=None) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json=body, headers=key("anon")))
        await wait_entered(probe)
        duplicate = await c.post(CREDIT, json=body, headers=key("anon"))
        held.release()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
    assert_problem(duplicate, 409, "request-in-flight")
    assert duplicate.headers["retry-after"] == "2"
    assert "location" not in duplicate.headers


async def test_a_method_the_library_routes_do_not_serve_is_a_405_problem_with_allow() -> None:
    """Found by probing: `POST` (or `DELETE` ...) to the status resource, or `GET` to the token
    route, was Starlette's plain-text 405, where the library answers problem+json everywhere
    else. It is `405 method-not-allowed` under the middleware's `problem_base` (given to the
    route or not), with `Allow`."""
    store = MemoryStore()
    base = "https://errors.example/"
    app = build_app(store, problem_base=base)
    app.router.routes[:0] = [
        status_route(store, path="/s", problem_base=base),
        token_route(TokenIssuer(store, secret=b"s" * 32), problem_base=base),
    ]
    async with client(app) as c:
        refused = [
            await c.post("/s", params={"operation": CREDIT_OP, "key": "k"}),
            await c.delete("/s"),
            await c.put(STATUS),  # (build_app's, given no base: the middleware's)
        ]
        tokens = await c.get("/idempotency/tokens")
        head = await c.head(STATUS, params={"operation": CREDIT_OP, "key": "k"})
    for r in refused:
        assert r.status_code == 405
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["type"].endswith("method-not-allowed")
        assert r.headers["allow"] == "GET, HEAD"
    assert [r.json()["type"].startswith(base) for r in refused] == [True, True, True]
    assert tokens.status_code == 405
    assert tokens.json()["type"] == f"{base}method-not-allowed"
    assert tokens.headers["allow"] == "POST"
    assert head.status_code == 404  # HEAD is served, as GET is


async def test_the_kill_switch_leaves_the_status_resource_answering() -> None:
    """Decided: the status resource is a route of the app, not of the middleware; with the
    middleware switched off (`enabled=False`), a client that got a 202 before the switch still
    learns the outcome from it."""
    store = MemoryStore()
    async with client(build_app(store)) as c:
        assert (await c.post(CREDIT, json={"amount": 5}, headers=key("k"))).status_code == 201
    async with client(build_app(store, enabled=False)) as c:
        r = await c.get(STATUS, params={"operation": CREDIT_OP, "key": "k"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "succeeded"


async def test_a_token_in_the_status_url_is_refused_and_never_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by probing: on a `require_token` operation, the status resource answered a token
    sent in the URL's `key` as readily as one in the header, and URLs land in access logs. It
    is refused (400 invalid-key, naming the header), whatever the token; the header still
    works. A wrong, another tenant's, or an unused token is a 404; a consumed one is found."""
    store = MemoryStore()
    issuer = TokenIssuer(store, secret=b"s" * 32)
    app = build_app(store, policies={CREDIT_OP: Policy(require_token=True)})
    app.router.routes.append(token_route(issuer))
    op = {"operation": CREDIT_OP}
    # (httpx itself logs every URL at INFO: the very reason a token stays out of it)
    with caplog.at_level(logging.DEBUG, logger="idem_middleware"):
        async with client(app) as c, client(app, token="demo-b") as other:
            token = (await c.post("/idempotency/tokens", json=op)).json()["token"]
            unused = await c.get(STATUS, params=op, headers=key(token))
            assert (await c.post(CREDIT, json={"amount": 5}, headers=key(token))).status_code == 201
            in_url = await c.get(STATUS, params={**op, "key": token})
            both = await c.get(STATUS, params={**op, "key": token}, headers=key(token))
            in_header = await c.get(STATUS, params=op, headers=key(token))
            theirs = await other.get(STATUS, params=op, headers=key(token))
            forged = await c.get(STATUS, params=op, headers=key("f" * 43))
    for refused in (in_url, both):
        detail = assert_problem(refused, 400, "invalid-key")["detail"]
        assert "Idempotency-Key header" in detail
        assert token not in refused.text
    assert in_header.json()["state"] == "succeeded", in_header.text
    for absent in (unused, theirs, forged):
        assert_problem(absent, 404, "record-not-found")
    ours = [r for r in caplog.records if r.name.startswith("idem_middleware")]
    assert not [r for r in ours if token in r.getMessage()]


async def test_an_operation_of_any_method_the_middleware_guards_is_looked_up_and_tokened() -> None:
    """Found by probing: the middleware guards any HTTP method token (`VERSION-CONTROL`,
    `M-SEARCH`), but the status resource and the token route took only letters: the 202's
    Location was a `400 invalid-key`, and no token could ever be issued for such a route."""
    store = MemoryStore()
    issuer = TokenIssuer(store, secret=b"s" * 32)
    gate, entered = asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> Response:
        entered.set()
        await gate.wait()
        return JSONResponse({}, 201)

    async def tokened(request: Request) -> Response:
        return JSONResponse({}, 201)

    methods = ["VERSION-CONTROL"]
    app = Starlette(
        routes=[
            Route(
                "/res",
                idempotent(accept_while_in_flight=True, wait_seconds=0.05)(slow),
                methods=methods,
            ),
            Route("/tok", idempotent(require_token=True)(tokened), methods=methods),
            token_route(issuer),
            status_route(store),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, methods=["POST", *methods]),
        ],
    )
    async with client(app) as c:
        first = asyncio.create_task(c.request("VERSION-CONTROL", "/res", headers=key("k")))
        await asyncio.wait_for(entered.wait(), BOUND)
        duplicate = await c.request("VERSION-CONTROL", "/res", headers=key("k"))
        assert duplicate.status_code == 202, duplicate.text
        status = await c.get(duplicate.headers["location"])
        gate.set()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
        issued = await c.post("/idempotency/tokens", json={"operation": "VERSION-CONTROL /tok"})
        assert issued.status_code == 201, issued.text
        used = await c.request("VERSION-CONTROL", "/tok", headers=key(issued.json()["token"]))
    assert status.status_code == 200, status.text
    assert status.json()["operation"] == "VERSION-CONTROL /res"
    assert used.status_code == 201, used.text


async def test_a_202_for_another_request_under_a_running_key_never_reads_as_its_success(
    store: Any,
) -> None:
    """Found by probing: in transactional mode a running original's fingerprint cannot be read
    (its claim is uncommitted), so a different request under its key got the 202 too, and its
    Location then said `succeeded`: the original's outcome, read as its own. The Location now
    carries a digest of its request, and once the original's record shows it differs the status
    resource answers `422 key-reused`; the same request's Location reads the outcome as before."""
    policy = Policy(accept_while_in_flight=True, wait_seconds=0.05)
    app = build_app(store, default_policy=policy)
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json={"amount": 1}, headers=key("k202")))
        await wait_entered(probe)
        other = await c.post(CREDIT, json={"amount": 999}, headers=key("k202"))
        same = await c.post(CREDIT, json={"amount": 1}, headers=key("k202"))
        assert (other.status_code, same.status_code) == (202, 202), other.text
        running = await c.get(other.headers["location"])
        held.release()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
        after_other = await c.get(other.headers["location"])
        after_same = await c.get(same.headers["location"])
        mangled = await c.get(other.headers["location"] + "&request=zz")
        bad = await c.get(other.headers["location"].replace("request=", "request=0"))
    assert other.headers["location"] != same.headers["location"]
    assert running.status_code == 200
    assert running.json()["state"] == "pending"
    assert_problem(after_other, 422, "key-reused")
    assert after_same.status_code == 200, after_same.text
    assert after_same.json()["state"] == "succeeded"
    assert_problem(mangled, 400, "invalid-key")  # (a repeated parameter)
    assert_problem(bad, 400, "invalid-key")


class _Hider:
    """Keeps the app it wraps to itself: routes below it cannot be seen from above."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._app(scope, receive, send)


async def _in_flight(app: Any, entered: asyncio.Event, gate: asyncio.Event, path: str) -> Any:
    """The 202 of a duplicate sent while the first request under its key runs, and the status
    resource's answer at its Location, followed at once."""
    async with client(app) as c:
        first = asyncio.create_task(c.post(path, json={}, headers=key("k")))
        await asyncio.wait_for(entered.wait(), BOUND)
        duplicate = await c.post(path, json={}, headers=key("k"))
        assert duplicate.status_code == 202, duplicate.text
        status = await c.get(duplicate.headers["location"])
        gate.set()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
    return duplicate.headers["location"], status


def _held() -> tuple[Any, asyncio.Event, asyncio.Event]:
    gate, entered = asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> Response:
        entered.set()
        await gate.wait()
        return JSONResponse({}, 201)

    return slow, entered, gate


_ACCEPTING = Policy(accept_while_in_flight=True, wait_seconds=0.05)


@pytest.mark.parametrize("name", ["a%09b", "a%0D%0Ab"])
async def test_the_location_of_an_operation_named_by_a_path_with_a_control_character_works(
    name: str,
) -> None:
    """Found by probing: a sub-app with its own middleware behind a wrapper that hides it, under
    `Mount("/shop/{name}", ...)`, names its operations by the concrete path the mounts took; one
    with a control character (`%09`, `%0D%0A`) was stored and named in the 202's Location, which
    the status resource refused (400 invalid-key). It looks up any name a record may hold (the
    name kept as it was: renamed, a retry across an upgrade would run again)."""
    store = MemoryStore()
    slow, entered, gate = _held()
    sub = Starlette(
        routes=[Route("/pay", slow, methods=["POST"]), status_route(store)],
        middleware=[Middleware(IdempotencyMiddleware, store=store, default_policy=_ACCEPTING)],
    )
    app = Starlette(
        routes=[Mount("/shop/{name}", app=_Hider(sub))],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )
    _, status = await _in_flight(app, entered, gate, f"/shop/{name}/pay")
    assert status.status_code == 200, status.text
    assert status.json()["state"] == "pending"
    assert status.json()["operation"] == "POST /shop/" + unquote(name) + "/pay"


async def test_the_location_of_a_root_path_starting_with_two_slashes_stays_on_this_host() -> None:
    """Found by probing: a root path that starts with `//` (a mount's `path` parameter, or a
    proxy's prefix copied into it) made the 202's Location `//evil.example/idempotency/status?
    ...&key=...`, a reference to another host carrying the key. It starts with one slash."""
    store = MemoryStore()
    slow, entered, gate = _held()
    routes = [Route("/pay", slow, methods=["POST"]), status_route(store)]
    app = Starlette(
        routes=[
            Mount(
                "/{where:path}",
                routes=routes,
                middleware=[
                    Middleware(IdempotencyMiddleware, store=store, default_policy=_ACCEPTING)
                ],
            )
        ],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )
    location, _ = await _in_flight(app, entered, gate, "http://test//evil.example/pay")
    assert location.startswith("/evil.example/"), location


@pytest.mark.parametrize(
    ("root", "encoded"), [("/caf\udce9", "/caf%E9"), ("/caf\ud800", "/caf%ED%A0%80")]
)
async def test_the_location_of_a_root_path_with_an_undecodable_byte_is_percent_encoded(
    root: str, encoded: str
) -> None:
    """Found by probing: a root path holding a lone surrogate (a server or a proxy's middleware
    that decodes the path with `surrogateescape`) failed the 202's Location with a
    UnicodeEncodeError, a 500 for the duplicate. The byte is percent-encoded as it came (and a
    surrogate no byte decodes to, as UTF-8 would write it)."""
    store = MemoryStore()
    slow, entered, gate = _held()
    inner = Starlette(
        routes=[Route("/pay", slow, methods=["POST"]), status_route(store)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=_ACCEPTING),
        ],
    )

    async def prefixed(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "root_path": root, "path": root + scope["path"]}
        await inner(scope, receive, send)

    async with client(prefixed) as c:
        first = asyncio.create_task(c.post("/pay", json={}, headers=key("k")))
        await asyncio.wait_for(entered.wait(), BOUND)
        duplicate = await c.post("/pay", json={}, headers=key("k"))
        gate.set()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
    assert duplicate.status_code == 202, duplicate.text
    assert duplicate.headers["location"].startswith(f"{encoded}/idempotency/status?")
