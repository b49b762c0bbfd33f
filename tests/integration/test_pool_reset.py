"""The store's own pool resets a connection on release only if code other than the store's had
it (store/postgres/store.py `_reset_connection`): the store's statements leave no session state, so
their reset query would be a round trip for nothing. A handler's connection, and any connection
taken from `store.pool` directly, is still reset: on the fast path by the message that commits
(the reset query after the COMMIT, store/postgres/fused.py), otherwise on release."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from tests.apps import BearerBackend, QueryLog, client, key, logged_store

RESET = "SELECT pg_advisory_unlock_all()"
LEAKED = "SELECT current_setting('idem_test.leak', true)"


async def leaky(request: Request) -> Response:
    """Leaves session state on the connection it was given: a setting outside any transaction
    scope (set_config with is_local false)."""
    ctx = get_context(request)
    conn = await ctx.fenced_connection() if ctx.mode is Mode.LEASE else ctx.connection
    await conn.execute("SELECT set_config('idem_test.leak', 'handler', false)")
    return JSONResponse({"ok": True}, status_code=201)


def _app(store: PostgresStore, mode: Mode) -> Starlette:
    return Starlette(
        routes=[Route("/leaky", leaky, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=Policy(mode=mode)),
        ],
    )


class Log(QueryLog):
    async def resets(self) -> tuple[int, int]:
        """Reset queries since the last call: (sent as messages of their own, on release;
        carried after the COMMIT by the message that commits). asyncpg calls a query logger
        soon after the message, not in it: the loop runs once first (a request may end without
        another turn of the loop since its last message, its connection given back at once)."""
        await asyncio.sleep(0)
        alone = sum(q.startswith(RESET) for q in self.queries)
        fused = sum(RESET in q and not q.startswith(RESET) for q in self.queries)
        self.queries.clear()
        return alone, fused


async def _leak(store: PostgresStore) -> str | None:
    async with store.pool.acquire() as conn:
        value: str | None = await conn.fetchval(LEAKED)
        return value


async def test_transactional_mode_resets_only_the_handlers_connection(db_dsn: str) -> None:
    log = Log()
    async with logged_store(db_dsn, log) as store:
        async with client(_app(store, Mode.TRANSACTIONAL)) as c:
            first = await c.post("/leaky", json={}, headers=key("tx-reset"))
            # The handler had the connection: reset by the message that commits, not after it.
            assert (await log.resets()) == (0, 1)
            assert await _leak(store) in (None, "")
            await log.resets()
            again = await c.post("/leaky", json={}, headers=key("tx-reset"))
            assert (await log.resets()) == (0, 0)  # a replay: only the store's statements
        assert await _leak(store) in (None, "")
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"


async def test_lease_mode_resets_only_the_fenced_connection(db_dsn: str) -> None:
    log = Log()
    async with logged_store(db_dsn, log) as store:
        async with client(_app(store, Mode.LEASE)) as c:
            first = await c.post("/leaky", json={}, headers=key("lease-reset"))
            # The claim's own statements: no reset; the fenced connection the handler wrote on:
            # reset, by the message that settles and commits.
            assert (await log.resets()) == (0, 1)
            assert await _leak(store) in (None, "")
            await log.resets()
            again = await c.post("/leaky", json={}, headers=key("lease-reset"))
            assert (await log.resets()) == (0, 0)
        assert await _leak(store) in (None, "")
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"


async def test_a_connection_taken_from_the_stores_pool_is_reset(db_dsn: str) -> None:
    log = Log()
    async with logged_store(db_dsn, log) as store:
        async with store.pool.acquire() as conn:
            await conn.execute("SELECT set_config('idem_test.leak', 'user', false)")
        assert (await log.resets()) == (1, 0)
        assert await _leak(store) in (None, "")


async def test_a_reset_of_the_callers_own_is_kept(db_dsn: str) -> None:
    log = Log()
    calls: list[object] = []

    async def reset(conn: asyncpg.Connection[Any]) -> None:
        calls.append(conn)
        await conn.reset()

    store = logged_store(db_dsn, log, reset=reset)
    async with store, client(_app(store, Mode.TRANSACTIONAL)) as c:
        await c.post("/leaky", json={}, headers=key("own-reset"))
        await c.post("/leaky", json={}, headers=key("own-reset"))
    assert len(calls) >= 2  # every release, the store's own statements' too
    assert (await log.resets())[1] == 0  # the caller's reset is the one that runs, on release
