"""A store given the app's own asyncpg pool (`PostgresStore(pool=...)`) and never opened counts as
open, so nothing ran `open()`'s checks on it: a database never migrated, sessions that take no
writes, a role without the grants, PgBouncer in transaction mode under a statement cache, each
let the app start, and every guarded request answered a plain 500. The middleware's startup now
runs those checks once (`startup_store.given_pool_error`), with `open()`'s ConfigurationError,
and leaves the app's pool open."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, PostgresStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.startup_store import given_pool_error
from idem_middleware.store import MemoryStore
from idem_middleware.store.migrations import migrate
from tests.apps import assert_problem, key
from tests.conftest import dsn_for
from tests.integration.test_startup_checks import client, startup
from tests.integration.test_store_access import APP_GRANTS, as_role
from tests.pgbouncer import binary

#: `await make(kind)`: the DSN of a new database where the store's `open()` refuses, as `kind`
#: says, or (kind "ok") a migrated one it opens.
Databases = Callable[[str], Awaitable[str]]

KINDS = ["unmigrated", "read-only", "missing-grant", "pgbouncer"]


@pytest.fixture
def bounced(request: pytest.FixtureRequest) -> str | None:
    """The suite's migrated database through PgBouncer in transaction pooling mode, for a test
    whose `kind` is "pgbouncer" (a plain fixture: it sets up async ones)."""
    if "kind" not in request.fixturenames or request.getfixturevalue("kind") != "pgbouncer":
        return None
    if binary() is None:
        pytest.skip("pgbouncer is not installed")
    dsn: str = request.getfixturevalue("bouncer").dsn("idem_test")
    return dsn


@pytest.fixture
async def databases(pg_dsn: str, bounced: str | None) -> AsyncIterator[Databases]:
    made: list[tuple[str, str]] = []

    async def make(kind: str) -> str:
        if kind == "pgbouncer":
            assert bounced is not None
            return bounced
        suffix = uuid.uuid4().hex[:10]
        name, role = f"idem_given_{suffix}", f"idem_app_{suffix}"
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
            made.append((name, role))
            if kind == "read-only":
                await admin.execute(
                    f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'
                )
            if kind == "missing-grant":
                await admin.execute(f"CREATE ROLE {role} LOGIN")
        finally:
            await admin.close()
        dsn = dsn_for(pg_dsn, name)
        if kind != "unmigrated":
            conn = await asyncpg.connect(
                dsn, server_settings={"default_transaction_read_only": "off"}
            )
            try:
                await migrate(conn)
                if kind == "missing-grant":
                    await conn.execute(APP_GRANTS.format(role=role))
                    await conn.execute(f"REVOKE USAGE ON SEQUENCE idem_generation_seq FROM {role}")
            finally:
                await conn.close()
        return as_role(dsn, role) if kind == "missing-grant" else dsn

    try:
        yield make
    finally:
        admin = await asyncpg.connect(pg_dsn)
        try:
            for name, role in made:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                await admin.execute(f"DROP ROLE IF EXISTS {role}")
        finally:
            await admin.close()


async def pay(request: Any) -> JSONResponse:
    return JSONResponse({"ok": True}, status_code=201)


def pay_app(store: Any, *, enabled: bool = True) -> Starlette:
    """One guarded route; no lifespan of its own (the app's pool is opened outside it)."""
    return Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                enabled=enabled,
                tenant_resolver=lambda scope: "t",
            )
        ],
    )


def middleware_of(store: Any, *, enabled: bool = True) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(pay_app(store), store=store, enabled=enabled)


async def refusal_of_open(dsn: str) -> str:
    """What `open()` says of a store given a pool of `dsn` (and then closed)."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        with pytest.raises(ConfigurationError) as refused:
            await PostgresStore(pool=pool).open()
    finally:
        await pool.close()
    return str(refused.value)


def probed(message: str) -> str:
    """`message`, the pooler check's statement named alike (a fresh name each time)."""
    return re.sub(r"idem_pooler_probe_\w+", "idem_pooler_probe", message)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_given_pool_gets_the_checks_of_open_and_stays_open(
    databases: Databases, kind: str
) -> None:
    dsn = await databases(kind)
    expected = await refusal_of_open(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        store = PostgresStore(pool=pool)
        error = await given_pool_error(middleware_of(store))
        assert isinstance(error, ConfigurationError)
        assert probed(str(error)) == probed(expected)
        # The pool is the app's: open, usable, and still the store's.
        assert not pool._closed
        assert await pool.fetchval("SELECT 1") == 1
        assert store.pool is pool
    finally:
        await pool.close()


async def test_a_given_pool_that_passes_is_checked_once(db_dsn: str) -> None:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=4)
    try:
        store = PostgresStore(pool=pool)
        opens: list[None] = []
        checks = store._open

        async def counted() -> None:
            opens.append(None)
            await checks()

        store._open = counted  # type: ignore[method-assign]
        mw = middleware_of(store)
        assert await given_pool_error(mw) is None
        assert await given_pool_error(mw) is None  # a second middleware, a second lifespan
        assert len(opens) == 1
        async with store:  # open() still checks (and counts) as it did
            assert await given_pool_error(mw) is None
        assert len(opens) == 2
        assert not pool._closed
    finally:
        await pool.close()


async def test_nothing_is_checked_for_a_store_of_its_own_another_store_or_a_switched_off_one(
    db_dsn: str,
) -> None:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    try:
        given = PostgresStore(pool=pool)
        assert await given_pool_error(middleware_of(given, enabled=False)) is None
        assert not given._given_checked
        own = PostgresStore(dsn=db_dsn)  # (not open: the startup says so; see unopened_store)
        assert await given_pool_error(middleware_of(own)) is None
        assert not own.is_open
        assert await given_pool_error(middleware_of(MemoryStore())) is None
    finally:
        await pool.close()


# -- wired into the middleware ---------------------------------------------------------------


async def test_a_lifespan_fails_for_a_given_pool_open_would_refuse(databases: Databases) -> None:
    dsn = await databases("unmigrated")
    expected = await refusal_of_open(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        sent = await startup(pay_app(PostgresStore(pool=pool)))
        assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
        assert sent[0]["message"] == f"idem_middleware: {expected}"
        assert not pool._closed
    finally:
        await pool.close()


async def test_without_a_lifespan_requests_are_refused_for_a_given_pool_open_would_refuse(
    databases: Databases,
) -> None:
    dsn = await databases("unmigrated")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        async with client(pay_app(PostgresStore(pool=pool))) as c:
            for attempt in ("k1", "k2"):
                r = await c.post("/pay", json={}, headers=key(attempt))
                assert_problem(r, 500, "server-misconfigured")
        assert not pool._closed
    finally:
        await pool.close()


async def test_a_check_that_cannot_run_now_fails_no_request(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No lifespan; the first request's check meets an error that is no verdict (a lock past
    the role's `lock_timeout`, a driver's own error): logged and skipped, and every request is
    served. (Left in the shared check, it failed every request after it with a plain 500, for
    good.)"""
    store = PostgresStore(pool=pool)

    async def cannot_run() -> None:
        raise asyncpg.exceptions.LockNotAvailableError("canceling statement due to lock timeout")

    monkeypatch.setattr(store, "check_given_pool", cannot_run)
    async with client(pay_app(store)) as c:
        for attempt in ("k1", "k2"):
            r = await c.post("/pay", json={}, headers=key(attempt))
            assert r.status_code == 201, r.text


async def test_a_check_that_ended_without_a_verdict_runs_again(pool: asyncpg.Pool[Any]) -> None:
    """A shared check cancelled with the loop that ran it (a test client's, say) is started
    again by the next request, not awaited again (its CancelledError failed every request)."""
    store = PostgresStore(pool=pool)
    app = pay_app(store)
    async with client(app) as c:
        r = await c.post("/pay", json={}, headers=key("k0"))  # builds the middleware stack
        assert r.status_code == 201, r.text
        mw = app.middleware_stack
        while not isinstance(mw, IdempotencyMiddleware):
            mw = mw.app
        cancelled = asyncio.get_running_loop().create_future()
        cancelled.cancel()
        mw._store_check = cancelled
        r = await c.post("/pay", json={}, headers=key("k1"))
        assert r.status_code == 201, r.text
        assert mw._store_check is True
