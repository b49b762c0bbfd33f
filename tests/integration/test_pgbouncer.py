"""PgBouncer in transaction pooling mode, checked on its own.

The suites that must hold through PgBouncer (the protocol, failure, peer-regression, token and
outbox suites, lease mode and the store contract) run through it by their "pgbouncer" database
route (`pytest.mark.db_routes`, tests/conftest.py): every statement goes through PgBouncer
(no protocol-level prepared statements, so `statement_cache_size=0`), with LISTEN off, so
lease-mode waiters are woken by polling alone. Tests that assert a NOTIFY wake-up are marked
`needs_listen` and run directly only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import Mode, Policy, PostgresStore
from idem_middleware.errors import ConfigurationError
from tests.pgbouncer import PgBouncer, binary

pytestmark = [
    pytest.mark.skipif(
        binary() is None, reason="pgbouncer is not installed (apt-get install -y pgbouncer)"
    ),
    pytest.mark.parametrize("db_route", ["pgbouncer"], indirect=True),
]


async def test_statements_really_go_through_pgbouncer(
    pool: asyncpg.Pool[Any], bouncer: PgBouncer
) -> None:
    async with pool.acquire() as conn:
        # The client side of this connection is PgBouncer's listening port, not PostgreSQL's.
        peer_port = conn._transport.get_extra_info("peername")[1]  # type: ignore[attr-defined]
        assert await conn.fetchval("SELECT 1") == 1
    assert peer_port == bouncer.port
    assert "login attempt: db=idem_test" in bouncer.log()
    assert pool._connect_kwargs["statement_cache_size"] == 0  # type: ignore[attr-defined]


async def test_lease_waiter_completes_by_polling_behind_pgbouncer(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """With LISTEN unavailable (PgBouncer), a duplicate of a pending lease request is answered
    by polling: it gets the replay once the original completes."""
    import asyncio

    from tests.apps import build_app, client

    app = build_app(pg_store, default_policy=Policy(mode=Mode.LEASE, wait_seconds=5))
    probe = app.state.probe
    probe.gate = asyncio.Event()
    async with client(app) as c:
        first = asyncio.ensure_future(
            c.post("/accounts/pb/credits", json={"amount": 2}, headers={"idempotency-key": "p"})
        )
        await asyncio.wait_for(probe.entered.wait(), 5)
        second = asyncio.ensure_future(
            c.post("/accounts/pb/credits", json={"amount": 2}, headers={"idempotency-key": "p"})
        )
        await asyncio.sleep(0.3)
        assert not second.done()  # it is waiting
        probe.gate.set()
        r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert (r1.status_code, r2.status_code) == (201, 201)
    assert r2.headers["idempotent-replayed"] == "true"
    assert probe.calls == 1


async def test_the_fast_path_runs_behind_pgbouncer_and_resets_in_the_message_that_commits(
    db_target: tuple[str, dict[str, Any]], pool: asyncpg.Pool[Any]
) -> None:
    """The fast path behind PgBouncer (which reports the client encoding as the client spelled
    it, `'utf-8'`), and the reset after the COMMIT in one message, through transaction pooling:
    answered, replayed, and the handler's writes committed once."""
    from tests.apps import QueryLog, build_app, client

    dsn, options = db_target
    log = QueryLog()
    store = PostgresStore(dsn=dsn, listen=False, connect_kwargs={**options, "init": log.attach})
    async with store, client(build_app(store)) as c:
        body, headers = {"amount": 3}, {"idempotency-key": "bounced"}
        first = await c.post("/accounts/pbr/credits", json=body, headers=headers)
        again = await c.post("/accounts/pbr/credits", json=body, headers=headers)
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    # (Prepared or inlined: PgBouncer moves the session between server connections.)
    assert any("; COMMIT; SELECT pg_advisory_unlock_all()" in q for q in log.queries)
    balance = await pool.fetchval("SELECT balance FROM test_accounts WHERE account_id = 'pbr'")
    assert balance == 3


@pytest.mark.parametrize("given", [False, True], ids=["own-pool", "given-pool"])
async def test_a_statement_cache_through_transaction_pooling_is_refused_when_the_store_opens(
    bouncer: PgBouncer, db_route: str, given: bool
) -> None:
    """asyncpg's default `statement_cache_size=100` through transaction pooling: the store
    opened, then a third of concurrent requests failed with 'prepared statement
    "__asyncpg_stmt_..." does not exist' (a plain 500) and the rest passed. Now the store
    refuses to open, naming `statement_cache_size=0`."""
    dsn = bouncer.dsn("idem_test")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4) if given else None
    try:
        store = PostgresStore(pool=pool) if pool else PostgresStore(dsn=dsn, listen=False)
        with pytest.raises(ConfigurationError) as refused:
            await store.open()
        assert "statement_cache_size=0" in str(refused.value)
        assert "statement_cache_size=100" in str(refused.value)
        assert "HINT" not in str(refused.value)  # (asyncpg's page of advice left out)
    finally:
        if pool is not None:
            assert not pool._closed  # a given pool is the caller's to close
            await pool.close()
    async with PostgresStore(dsn=dsn, listen=False, statement_cache_size=0):
        pass


async def test_a_statement_cache_through_session_pooling_is_left_alone(
    pg_dsn: str, db_dsn: str, db_route: str
) -> None:
    """In session mode each client connection keeps its server session, and its statements:
    the cache works there, and the store opens with it."""
    from tests.apps import build_app, client

    session = PgBouncer(pg_dsn, pool_mode="session").start()
    try:
        store = PostgresStore(dsn=session.dsn("idem_test"), listen=False)
        async with store, client(build_app(store)) as c:
            answers = await asyncio.gather(
                *(
                    c.post(
                        f"/accounts/s{i}/credits",
                        json={"amount": 1},
                        headers={"idempotency-key": f"session-{i}"},
                    )
                    for i in range(8)
                )
            )
    finally:
        session.stop()
    assert [r.status_code for r in answers] == [201] * 8


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_claim_waiting_inside_pgbouncer_past_its_query_wait_timeout_is_a_503(
    pg_dsn: str, db_dsn: str, db_route: str, mode: Mode
) -> None:
    """PgBouncer's server pool is full (one server connection, held by a transaction): the
    store's pool hands out a client connection at once, so `acquire_timeout` never fires, and the
    claim waits inside PgBouncer. PgBouncer's `query_wait_timeout` bounds that wait (what
    docs/operating.md tells operators to set); its error is answered 503 store-unavailable,
    nothing ran, and the same key succeeds once a server connection is free."""
    from tests.apps import assert_problem, build_app, client

    full = PgBouncer(pg_dsn, pool_size=1, settings={"query_wait_timeout": 1}).start()
    try:
        dsn = full.dsn("idem_test")
        store = PostgresStore(dsn=dsn, listen=False, statement_cache_size=0, max_size=2)
        app = build_app(store, default_policy=Policy(mode=mode))
        path = f"/accounts/qwt-{mode.value}/credits"
        headers = {"idempotency-key": f"qwt-{mode.value}"}
        async with store, client(app) as c:
            holder = await asyncpg.connect(dsn, statement_cache_size=0)
            try:
                holding = holder.transaction()
                await holding.start()
                await holder.execute("SELECT 1")  # the only server connection is this one's
                waited = await asyncio.wait_for(
                    c.post(path, json={"amount": 1}, headers=headers),
                    30,  # (a hang bound, not a timing: PgBouncer's own timeout answers first)
                )
                await holding.rollback()
            finally:
                await holder.close()
            assert app.state.probe.calls == 0
            again = await c.post(path, json={"amount": 1}, headers=headers)
    finally:
        full.stop()
    assert_problem(waited, 503, "store-unavailable")
    assert waited.headers["retry-after"]
    assert again.status_code == 201, again.text
    assert app.state.probe.calls == 1


@pytest.mark.parametrize("given", [False, True], ids=["own-pool", "given-pool"])
async def test_a_store_behind_statement_pooling_is_refused_when_it_opens(
    pg_dsn: str, db_dsn: str, db_route: str, given: bool
) -> None:
    """PgBouncer in statement mode closes a client connection that leaves a transaction open:
    the store opened, then every transactional request was answered 503 (its claim's BEGIN
    refused). Now the store refuses to open, naming the pool mode."""
    statement = PgBouncer(pg_dsn, pool_mode="statement").start()
    try:
        dsn = statement.dsn("idem_test")
        pool = (
            await asyncpg.create_pool(dsn, min_size=1, max_size=4, statement_cache_size=0)
            if given
            else None
        )
        try:
            store = (
                PostgresStore(pool=pool)
                if pool
                else PostgresStore(dsn=dsn, listen=False, statement_cache_size=0)
            )
            with pytest.raises(ConfigurationError) as refused:
                await store.open()
        finally:
            if pool is not None:
                await pool.close()
        # Whatever the statement cache: the pool mode is named, not the cache.
        with pytest.raises(ConfigurationError) as cached:
            await PostgresStore(dsn=dsn, listen=False).open()
    finally:
        statement.stop()
    for error in (refused.value, cached.value):
        assert "pool_mode = statement" in str(error)
        assert "transaction blocks not allowed" in str(error)  # PgBouncer's own words


async def test_two_client_connections_meeting_on_one_server_session_fall_back_to_inlining(
    pg_dsn: str, db_dsn: str, db_route: str, pool: asyncpg.Pool[Any]
) -> None:
    """PgBouncer with one server connection behind two of the store's: the first claim PREPAREs
    the fast statements on that server session; the other client connection's first claim
    PREPAREs them again there and meets 'already exists'. The store inlines from then on, and
    every request is answered as if nothing happened (its handler's writes committed once)."""
    from tests.apps import QueryLog, build_app, client

    one = PgBouncer(pg_dsn, pool_size=1).start()
    log = QueryLog()
    try:
        store = PostgresStore(
            dsn=one.dsn("idem_test"),
            listen=False,
            statement_cache_size=0,
            min_size=2,
            max_size=2,
            connect_kwargs={"init": log.attach},
        )
        async with store, client(build_app(store)) as c:

            async def post(k: str) -> Any:
                body = {"amount": 1}
                return await c.post(
                    "/accounts/met/credits", json=body, headers={"idempotency-key": k}
                )

            answers = [await post("m1")]
            # The connection that prepared is held (in no transaction: that holds no server
            # session in transaction mode), so the next request has the other one.
            async with store.pool.acquire():
                answers.append(await post("m2"))
            answers += [await post("m3"), await post("m1")]
    finally:
        one.stop()
    assert [r.status_code for r in answers] == [201] * 4
    assert answers[-1].headers["idempotent-replayed"] == "true"
    claims = [q for q in log.queries if "idem_claim_key" in q]
    assert claims[0].startswith("PREPARE ")  # the first client connection's
    assert claims[1].startswith("PREPARE ")  # the second's, on the same server session: refused
    assert claims[2].startswith("BEGIN; SELECT * FROM idem_claim_key(")  # sent again, inlined
    assert all(not q.startswith(("PREPARE", "EXECUTE")) for q in claims[3:])
    assert await pool.fetchval("SELECT balance FROM test_accounts WHERE account_id = 'met'") == 3


async def test_a_fenced_transaction_ended_by_idle_transaction_timeout_is_a_503_and_unknown(
    pg_dsn: str, db_dsn: str, db_route: str
) -> None:
    """PgBouncer's `idle_transaction_timeout` closes a lease-mode handler's fenced connection
    while the handler waits (on a slow downstream call, say); its next fenced write raises
    asyncpg's "connection was closed". The client was answered a plain 500 (the handler's
    exception); the store failed, not the handler: now 503 store-unavailable, as a failed
    fenced settlement is. The record is `unknown` (the downstream call may have happened), the
    fenced writes rolled back, and a retry runs nothing."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from idem_middleware import get_context
    from tests.apps import LEDGER_INSERT, assert_problem, client, one_route_app, until

    calls = 0

    async def handler(request: Request) -> Response:
        nonlocal calls
        calls += 1
        ctx = get_context(request)
        conn = await ctx.fenced_connection()
        await conn.execute(LEDGER_INSERT, ctx.tenant, "slow", 1)
        # The downstream call takes longer than PgBouncer lets a transaction sit idle.
        await until(conn.is_closed)
        await conn.execute(LEDGER_INSERT, ctx.tenant, "slow", 1)
        return JSONResponse({}, status_code=201)

    idle = PgBouncer(pg_dsn, settings={"idle_transaction_timeout": 1}).start()
    direct = await asyncpg.connect(db_dsn)
    try:
        await direct.execute("TRUNCATE idem_requests, test_ledger")
        store = PostgresStore(dsn=idle.dsn("idem_test"), listen=False, statement_cache_size=0)
        policy = Policy(mode=Mode.LEASE, lease_seconds=30, wait_seconds=0.2)
        app = one_route_app("/slow", handler, store=store, default_policy=policy)
        headers = {"idempotency-key": "idle-fence"}
        async with store, client(app) as c:
            first = await c.post("/slow", json={}, headers=headers)
            again = await c.post("/slow", json={}, headers=headers)
        state = await direct.fetchval("SELECT state FROM idem_requests")
        ledger = await direct.fetchval("SELECT count(*) FROM test_ledger")
    finally:
        await direct.close()
        idle.stop()
    assert_problem(first, 503, "store-unavailable")
    assert state == "unknown"
    assert ledger == 0
    assert_problem(again, 409, "outcome-unknown")
    assert calls == 1


@pytest.mark.parametrize("given", [False, True], ids=["own-pool", "given-pool"])
async def test_a_store_listening_through_transaction_pooling_is_refused_when_it_opens(
    bouncer: PgBouncer, db_route: str, given: bool
) -> None:
    """`listen=True` (the default) with no `listen_dsn`, through PgBouncer in transaction mode:
    the store opened, its LISTEN landed on whichever server session was free, and no waiter was
    ever woken by a notification (each settlement still sent one, and PgBouncer logged `got
    packet 'A' from server when not linked`); nothing said so. Now the store refuses to open,
    naming listen=False and listen_dsn; with either it opens."""
    dsn = bouncer.dsn("idem_test")
    pool = (
        await asyncpg.create_pool(dsn, min_size=1, max_size=4, statement_cache_size=0)
        if given
        else None
    )
    try:
        store = (
            PostgresStore(pool=pool)
            if pool
            else PostgresStore(dsn=dsn, statement_cache_size=0, max_size=4)
        )
        with pytest.raises(ConfigurationError) as refused:
            await store.open()
        assert "listen=False" in str(refused.value)
        assert "listen_dsn" in str(refused.value)
        if pool is not None:
            assert not pool._closed  # a given pool is the caller's to close
    finally:
        if pool is not None:
            await pool.close()
    async with PostgresStore(dsn=dsn, statement_cache_size=0, listen=False):
        pass


async def test_a_store_listening_on_a_direct_listen_dsn_behind_pgbouncer_opens(
    bouncer: PgBouncer, db_dsn: str, db_route: str
) -> None:
    """The fix the refusal names: the pool through PgBouncer, LISTEN on a direct connection."""
    store = PostgresStore(dsn=bouncer.dsn("idem_test"), statement_cache_size=0, listen_dsn=db_dsn)
    async with store:
        pass


async def test_lease_renewals_run_through_pgbouncer_on_a_client_connection_of_their_own(
    pool: asyncpg.Pool[Any], bouncer: PgBouncer, db_route: str
) -> None:
    """The renewals' connection is made as the given pool makes its own (PgBouncer's port,
    `statement_cache_size=0`), outside it: renewals go on while the pool's every connection is
    held, statement after statement on whichever server session PgBouncer hands them."""
    from idem_middleware.store.base import Claimed, RecordKey

    key = RecordKey("t", "POST /payouts", "renewed")
    async with PostgresStore(pool=pool, listen=False) as store:
        claimed = await store.claim_lease(key, b"f" * 32, retention_seconds=60, lease_seconds=30)
        assert isinstance(claimed, Claimed)
        held = [await pool.acquire() for _ in range(pool.get_max_size())]
        try:
            for _ in range(5):
                assert await store.heartbeat(key, claimed.generation, 30)
        finally:
            for conn in held:
                await pool.release(conn)
        conn = store._renewals._conn
        assert conn._transport.get_extra_info("peername")[1] == bouncer.port
        assert conn._stmt_cache.get_max_size() == 0


async def test_a_store_opened_while_pgbouncer_cannot_log_in_is_not_called_statement_pooling(
    pg_dsn: str, db_dsn: str, db_route: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PgBouncer that has served a database accepts a client's login from what it cached, and
    answers its first statement with its own error when it cannot log in to the server (a
    restart under way; here the database takes no connections): the same code as statement
    mode's refusal. The store opens, saying it could not check (requests are 503 until the
    server is back), and no longer refuses to open as if the pool mode were wrong."""
    admin = await asyncpg.connect(pg_dsn)
    await admin.execute('DROP DATABASE IF EXISTS "idem_bouncer_down" WITH (FORCE)')
    await admin.execute('CREATE DATABASE "idem_bouncer_down"')
    bouncer = PgBouncer(pg_dsn, pool_size=2, settings={"query_wait_timeout": 1}).start()
    try:
        dsn = bouncer.dsn("idem_bouncer_down")
        served = await asyncpg.connect(dsn, statement_cache_size=0)
        await served.fetchval("SELECT 1")  # PgBouncer has served this database
        await served.close()
        await admin.execute('ALTER DATABASE "idem_bouncer_down" ALLOW_CONNECTIONS false')
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = 'idem_bouncer_down'"
        )
        store = PostgresStore(dsn=dsn, listen=False, statement_cache_size=0)
        await asyncio.wait_for(store.open(), 60)  # (a hang bound)
        await store.close()
    finally:
        bouncer.stop()
        await admin.execute('DROP DATABASE IF EXISTS "idem_bouncer_down" WITH (FORCE)')
        await admin.close()
    assert "cannot check the idempotency schema now" in caplog.text
