"""The PostgreSQL server in states a deployment meets while the app runs: sessions that take no
writes (a hot standby the DSN reaches after a failover, or `default_transaction_read_only` set
for maintenance), a server that refuses new connections (`max_connections`, or a role's or
database's connection limit), and statements it cancels (`statement_timeout`). Each answers
`503 store-unavailable` with Retry-After (they were 500s, asyncpg's errors escaping the store),
commits nothing, and the store recovers by itself: the retry runs once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Policy, PostgresStore, get_context
from idem_middleware.errors import StoreError
from idem_middleware.policy import Mode
from idem_middleware.store.base import (
    Claimed,
    RecordKey,
    Settlement,
    State,
    StoredResponse,
)
from idem_middleware.store.migrations import migrate
from tests.apps import assert_problem, assert_replay_of, client, one_route_app
from tests.conftest import dsn_for

POLICIES = {
    "transactional": Policy(),
    "lease": Policy(mode=Mode.LEASE, lease_seconds=5.0, wait_seconds=0.3),
}


class Own:
    """A database of its own, owned (and migrated) by a login role of its own, so that its
    settings and the role's connection limit disturb no other test."""

    def __init__(self, admin: str, name: str, role: str) -> None:
        self.admin, self.name, self.role = admin, name, role
        parts = urlsplit(dsn_for(admin, name))
        host = parts.netloc.rsplit("@", 1)[-1]
        self.dsn = urlunsplit(parts._replace(netloc=f"{role}@{host}"))

    async def run(self, statement: str) -> None:
        conn = await asyncpg.connect(self.admin)
        try:
            await conn.execute(statement.format(name=self.name, role=self.role))
        finally:
            await conn.close()


@pytest.fixture
async def own(pg_dsn: str) -> AsyncIterator[Own]:
    suffix = uuid.uuid4().hex[:10]
    made = Own(pg_dsn, f"idem_states_{suffix}", f"idem_states_{suffix}")
    await made.run("CREATE ROLE {role} LOGIN")
    await made.run('CREATE DATABASE "{name}" OWNER {role}')
    try:
        conn = await asyncpg.connect(made.dsn)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        yield made
    finally:
        await made.run('DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await made.run("DROP ROLE IF EXISTS {role}")


KEY = RecordKey("tenant-a", "POST /charges", "read-only")


def counting_app(store: PostgresStore, mode: str) -> tuple[Any, list[int]]:
    """`POST /charges` guarded in `mode`; the list counts its handler's runs. The handler writes
    nothing itself: every write is the store's."""
    runs: list[int] = []

    async def charge(request: Request) -> Response:
        get_context(request)
        runs.append(1)
        return JSONResponse({"run": len(runs)}, status_code=201)

    app = one_route_app("/charges", charge, store=store, policies={"POST /charges": POLICIES[mode]})
    return app, runs


def assert_unavailable(response: Any) -> None:
    assert_problem(response, 503, "store-unavailable")
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("mode", list(POLICIES))
async def test_sessions_that_take_no_writes_answer_503_and_recover(own: Own, mode: str) -> None:
    """The store opened on a writable server; then its new sessions became read-only (what a
    failover to a standby looks like to a pool). A lease claim, a transactional completion: each
    is refused by the server, and was a 500 with asyncpg's error."""
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        app, runs = counting_app(store, mode)
        await own.run('ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        await store.pool.expire_connections()  # (its connections are replaced: new sessions)
        headers = {"Idempotency-Key": "read-only"}
        async with client(app) as c:
            for _ in range(2):
                assert_unavailable(await c.post("/charges", json={}, headers=headers))
            assert await store.get(KEY) is None
            await own.run('ALTER DATABASE "{name}" SET default_transaction_read_only = off')
            await store.pool.expire_connections()
            refused = len(runs)  # (run and rolled back, or refused at the claim: not committed)
            first = await c.post("/charges", json={}, headers=headers)
            assert first.status_code == 201, first.text
            assert len(runs) == refused + 1
            assert_replay_of(await c.post("/charges", json={}, headers=headers), first)
        assert len(runs) == refused + 1
        assert await store.get(KEY) is not None
    if mode == "lease":
        assert refused == 0  # (its claim is the store's first write)


#: How a server refuses the pool's new connections, and how it takes them again: the role's
#: connection limit (53300 too_many_connections, as `max_connections`), and the database closed
#: for maintenance (55000 object_not_in_prerequisite_state: "not currently accepting
#: connections"; a 500, or lease mode's `server-misconfigured`, before it was a 503).
REFUSALS = {
    "connection limit": (
        "ALTER ROLE {role} CONNECTION LIMIT 0",
        "ALTER ROLE {role} CONNECTION LIMIT -1",
    ),
    "database closed": (
        'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false',
        'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true',
    ),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
@pytest.mark.parametrize("mode", list(POLICIES))
async def test_a_server_refusing_connections_answers_503_and_recovers(
    own: Own, mode: str, refusal: str
) -> None:
    """The pool must open a connection and the server refuses it: a 500 with asyncpg's error,
    now a 503; once the server takes connections again, the retry runs once."""
    refuse, take = REFUSALS[refusal]
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        app, runs = counting_app(store, mode)
        await own.run(refuse)
        await store.pool.expire_connections()  # (the next checkout opens a new one)
        headers = {"Idempotency-Key": "no-connections"}
        async with client(app) as c:
            for _ in range(2):
                assert_unavailable(await c.post("/charges", json={}, headers=headers))
            assert runs == []
            await own.run(take)
            first = await c.post("/charges", json={}, headers=headers)
            assert first.status_code == 201, first.text
            assert_replay_of(await c.post("/charges", json={}, headers=headers), first)
        assert len(runs) == 1


async def test_a_claim_the_server_ends_for_idling_answers_503_and_runs_once_on_retry(
    own: Own, caplog: pytest.LogCaptureFixture
) -> None:
    """`idle_in_transaction_session_timeout` on the database (a common managed default): a
    transactional handler that waits past it between two statements has its session ended by
    the server. Its next statement failed with asyncpg's "connection has been released back to
    the pool", a 500 from the app; now it is a 503 whose log names the timeout. Nothing
    committed, and the retry runs once."""
    await own.run("ALTER DATABASE \"{name}\" SET idle_in_transaction_session_timeout = '100ms'")
    runs: list[int] = []
    watcher = await asyncpg.connect(own.admin)

    async def charge(request: Request) -> Response:
        ctx = get_context(request)
        runs.append(1)
        conn = ctx.connection
        assert conn is not None
        if len(runs) == 1:  # the first run waits (on an HTTP call, say) until the server ended it
            pid = conn.get_server_pid()
            for _ in range(400):
                if not await watcher.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
                ):
                    break
                await asyncio.sleep(0.025)
            else:
                raise AssertionError("the server did not end the idle session")
        await conn.execute("SELECT 1")
        return JSONResponse({"run": len(runs)}, status_code=201)

    try:
        async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
            app = one_route_app(
                "/charges",
                charge,
                store=store,
                policies={"POST /charges": POLICIES["transactional"]},
            )
            headers = {"Idempotency-Key": "idle"}
            async with client(app) as c:
                caplog.clear()  # (the open's INFO line names the setting too)
                with caplog.at_level(logging.WARNING, logger="idem_middleware"):
                    assert_unavailable(await c.post("/charges", json={}, headers=headers))
                # (The records' own words: caplog.text holds tracebacks too, whose source lines
                # name the setting whatever the message says.)
                said = [r.getMessage() + str(r.exc_info and r.exc_info[1]) for r in caplog.records]
                assert any("idle_in_transaction_session_timeout" in s for s in said), said
                assert await store.get(RecordKey("tenant-a", "POST /charges", "idle")) is None
                first = await c.post("/charges", json={}, headers=headers)
                assert first.status_code == 201, first.text
                assert_replay_of(await c.post("/charges", json={}, headers=headers), first)
    finally:
        await watcher.close()
    assert len(runs) == 2


@pytest.mark.parametrize("mode", list(POLICIES))
async def test_a_statement_the_server_cancels_answers_503_and_runs_once_on_retry(
    own: Own, mode: str
) -> None:
    """`statement_timeout` on the role or database (or a DBA's `pg_cancel_backend`): the server
    cancels a statement of the store's that waited (here behind a lock on the table, as behind
    DDL). Found by probing: lease mode's claim let asyncpg's QueryCanceledError escape, a 500;
    now it is a 503, as in transactional mode, nothing is recorded, and the retry runs once."""
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        app, runs = counting_app(store, mode)
        await own.run("ALTER DATABASE \"{name}\" SET statement_timeout = '200ms'")
        await store.pool.expire_connections()  # (new sessions, with the timeout)
        headers = {"Idempotency-Key": "cancelled"}
        locker = await asyncpg.connect(own.dsn, server_settings={"statement_timeout": "0"})
        try:
            async with client(app) as c:
                async with locker.transaction():
                    await locker.execute("LOCK TABLE idem_requests IN EXCLUSIVE MODE")
                    assert_unavailable(await c.post("/charges", json={}, headers=headers))
                assert runs == []
                assert await store.get(RecordKey("tenant-a", "POST /charges", "cancelled")) is None
                first = await c.post("/charges", json={}, headers=headers)
                assert first.status_code == 201, first.text
                assert_replay_of(await c.post("/charges", json={}, headers=headers), first)
        finally:
            await locker.close()
    assert len(runs) == 1


async def test_a_settlement_the_server_cancels_is_a_store_error(own: Own) -> None:
    """Lease mode's settlement (a statement that commits on its own) cancelled by the server's
    `statement_timeout`: StoreError, as any store failure there (the record stays pending until
    its lease lapses), not asyncpg's QueryCanceledError."""
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        claim = await store.claim_lease(KEY, b"f", retention_seconds=60, lease_seconds=60)
        assert isinstance(claim, Claimed)
        await own.run("ALTER DATABASE \"{name}\" SET statement_timeout = '200ms'")
        await store.pool.expire_connections()
        locker = await asyncpg.connect(own.dsn, server_settings={"statement_timeout": "0"})
        try:
            async with locker.transaction():
                await locker.execute("LOCK TABLE idem_requests IN EXCLUSIVE MODE")
                done = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
                with pytest.raises(StoreError, match="cancel"):
                    await store.settle(KEY, claim.generation, State.PENDING, done)
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.PENDING
        finally:
            await locker.close()
