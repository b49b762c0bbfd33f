"""A connection lost around the end of a request (store/postgres/runner.py, fenced.py): the
server drops it (here: `pg_terminate_backend` from another session) after the COMMIT went through,
or while a lease-mode handler still holds its fenced connection. A committed outcome stands and
is answered as committed; a lost fenced connection is the store's trouble (503), or, when the
handler raised, the record's `unknown` at once, never a driver error escaping as a 500."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from idem_middleware.store.postgres import fenced, sessions
from tests.apps import BearerBackend, assert_problem, client, key

#: Over the fast path's limit (64 KiB): the outcome is written and committed on its own, and
#: the connection's reset goes with the release, after the COMMIT.
BIG = b"x" * 70_000


async def _connection(request: Request) -> Any:
    ctx = get_context(request)
    return await ctx.fenced_connection() if ctx.mode is Mode.LEASE else ctx.connection


async def _write(request: Request) -> Any:
    ctx = get_context(request)
    conn = await _connection(request)
    await conn.execute(
        "INSERT INTO release_effects (tenant, k) VALUES ($1, $2)", ctx.tenant, ctx.key
    )
    return conn


async def big(request: Request) -> Response:
    await _write(request)
    return Response(BIG, status_code=201, media_type="application/octet-stream")


class _Killer:
    """Terminates server backends from a session of its own."""

    def __init__(self, admin: asyncpg.Connection) -> None:  # type: ignore[type-arg]
        self.admin = admin
        self.spins = 0
        self.killed = 0

    async def kill(self, pid: int) -> None:
        await self.admin.execute("SELECT pg_terminate_backend($1)", pid)
        self.killed += 1
        for _ in range(self.spins):  # how far asyncpg got in noticing, before the release
            await asyncio.sleep(0)


async def dies(request: Request) -> Response:
    """Writes, then its (fenced) connection dies; returns 201 or raises (`x-raise: 1`)."""
    conn = await _write(request)
    killer: _Killer = request.app.state.killer
    await killer.kill(conn.get_server_pid())
    await asyncio.sleep(0.2)  # (asyncpg notices)
    if request.headers.get("x-raise") == "1":
        raise RuntimeError("the handler fails after its connection died")
    return JSONResponse({"ok": True}, status_code=201)


def _app(store: PostgresStore, mode: Mode, killer: _Killer) -> Starlette:
    app = Starlette(
        routes=[Route("/big", big, methods=["POST"]), Route("/dies", dies, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(
                IdempotencyMiddleware,
                store=store,
                default_policy=Policy(mode=mode, lease_seconds=30),
            ),
        ],
    )
    app.state.killer = killer
    return app


@pytest.fixture
async def killer(db_dsn: str) -> AsyncIterator[_Killer]:
    admin = await asyncpg.connect(db_dsn)
    try:
        await admin.execute(
            "CREATE TABLE IF NOT EXISTS release_effects (tenant text NOT NULL, k text NOT NULL)"
        )
        # The keys are fixed names: what a run of these tests (or another test) left would be
        # replayed (`killed == 0`, a 409 for a 500), so each starts from empty tables, as the
        # `pool` fixture's tests do.
        await admin.execute("DELETE FROM idem_requests; DELETE FROM release_effects")
        yield _Killer(admin)
    finally:
        await admin.close()


async def _state(killer: _Killer, name: str) -> tuple[str | None, int]:
    state = await killer.admin.fetchval("SELECT state FROM idem_requests WHERE idem_key = $1", name)
    effects = await killer.admin.fetchval("SELECT count(*) FROM release_effects WHERE k = $1", name)
    return state, effects


#: How many event-loop turns pass between the kill and the release: how far asyncpg got in
#: noticing the lost connection decides which error the release raises (and whether it raises:
#: each is tried a few times).
SPINS = [*range(6)] * 3


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_connection_lost_after_the_commit_leaves_the_committed_answer(
    db_dsn: str, killer: _Killer, monkeypatch: pytest.MonkeyPatch, mode: Mode
) -> None:
    """The server drops the connection right after the COMMIT: the release's reset then fails
    with whatever asyncpg makes of it (InternalClientError, InterfaceError, OSError...). The
    client gets the committed 201, a retry its replay, and the pool goes on with new ones."""
    if mode is Mode.TRANSACTIONAL:
        commit = sessions.PgTransaction._commit

        async def _commit(self: sessions.PgTransaction) -> None:
            pid = self.driver.get_server_pid()
            await commit(self)  # the COMMIT went through
            await killer.kill(pid)  # then the backend dies

        monkeypatch.setattr(sessions.PgTransaction, "_commit", _commit)
    else:
        settle = fenced.Fencing.settle

        async def _settle(self: fenced.Fencing, s: Any) -> bool:
            pid = self.connection.get_server_pid()
            done = await settle(self, s)  # committed with the settlement
            await killer.kill(pid)
            return done

        monkeypatch.setattr(fenced.Fencing, "settle", _settle)
    names = [f"after-commit-{mode.value}-{i}" for i in range(len(SPINS))]
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    async with store, client(_app(store, mode, killer)) as c:
        firsts = []
        for spins, name in zip(SPINS, names, strict=True):
            killer.spins = spins
            firsts.append(await c.post("/big", json={}, headers=key(name)))
        monkeypatch.undo()
        agains = [await c.post("/big", json={}, headers=key(name)) for name in names]
    assert killer.killed == len(names)
    assert [r.status_code for r in firsts] == [201] * len(names), [r.text[:200] for r in firsts]
    assert all(r.content == BIG for r in firsts)
    assert [r.status_code for r in agains] == [201] * len(names)
    assert all(r.headers["idempotent-replayed"] == "true" for r in agains)
    assert [await _state(killer, name) for name in names] == [("succeeded", 1)] * len(names)


@pytest.mark.parametrize("fast", [True, False])
async def test_a_lost_fenced_connection_is_the_stores_trouble_not_a_500(
    db_dsn: str, killer: _Killer, fast: bool
) -> None:
    """The handler's fenced connection dies and the handler returns: its settlement cannot be
    written, and that is answered 503 store-unavailable (the rollback of a dead connection does
    not replace it with a driver error)."""
    name = f"fence-dies-{fast}"
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast)
    async with store, client(_app(store, Mode.LEASE, killer)) as c:
        first = await c.post("/dies", json={}, headers=key(name))
    assert_problem(first, 503, "store-unavailable")
    state, effects = await _state(killer, name)
    assert state in ("pending", "unknown")  # never settled as done
    assert effects == 0  # the fenced write died with its transaction


@pytest.mark.parametrize("fast", [True, False])
async def test_a_handler_raising_after_its_fenced_connection_died_leaves_the_record_unknown(
    db_dsn: str, killer: _Killer, fast: bool
) -> None:
    """An exception from the handler makes the record `unknown` at once (docs/lease-mode.md),
    even when its fenced connection is gone: a retry is told so, not 'in flight' until the
    lease lapses."""
    name = f"fence-dies-raises-{fast}"
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast)
    raising = {**key(name), "x-raise": "1"}
    async with store, client(_app(store, Mode.LEASE, killer)) as c:
        started = time.monotonic()
        first = await c.post("/dies", json={}, headers=raising)
        assert first.status_code == 500  # (the handler's own exception)
        assert await _state(killer, name) == ("unknown", 0)
        again = await c.post("/dies", json={}, headers=key(name))
    assert time.monotonic() - started < 10  # (the lease is 30 s)
    assert_problem(again, 409, "outcome-unknown")
