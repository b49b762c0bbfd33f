"""A guarded route that takes the claim's database connection (`IdempotencyConnection`,
`ClaimSession`, a `ClaimSessions(...).dependency`) cannot run on `MemoryStore`, whose claims have
none: startup refuses it, naming the route, rather than every request failing with a 500 from
inside the dependency (or from SQLAlchemy's pool). A route that takes only the context
(`Idempotency`) still runs on it, as does one whose connection a test overrides."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import pytest
from fastapi import Depends, FastAPI
from starlette.middleware.authentication import AuthenticationMiddleware

from idem_middleware import MemoryStore, Mode, idempotent
from idem_middleware.fastapi import (
    Idempotency,
    IdempotencyConnection,
    install,
    transaction_connection,
)
from idem_middleware.sqla import ClaimSession, ClaimSessions, claim_session
from idem_middleware.store.postgres import PostgresStore
from tests.apps import BearerBackend, assert_replay_of, client
from tests.integration.test_startup_checks import messages, startup

NO_CONNECTION = (
    "but the store is a MemoryStore, whose claims have no database connection: use PostgresStore"
)
SESSIONS = ClaimSessions()


def key(value: str) -> dict[str, str]:
    return {"idempotency-key": value}


class Calls:
    def __init__(self) -> None:
        self.n = 0


def connection_app(store: MemoryStore | PostgresStore, calls: Calls) -> FastAPI:
    app = FastAPI()

    @app.post("/session")
    async def session(session: ClaimSession) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.post("/leased-session")
    @idempotent(mode=Mode.LEASE)
    async def leased_session(session: ClaimSession) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.post("/own-sessions")
    async def own_sessions(
        session: Annotated[Any, Depends(SESSIONS.dependency)],
    ) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.post("/raw")
    async def raw(conn: IdempotencyConnection) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    @app.post("/context")
    async def context(idem: Idempotency) -> dict[str, bool]:
        calls.n += 1
        return {"ok": True}

    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


def context_app(calls: Calls) -> FastAPI:
    app = FastAPI()

    @app.post("/context")
    async def context(idem: Idempotency) -> dict[str, int]:
        calls.n += 1
        return {"generation": idem.generation}

    @app.post("/leased")
    @idempotent(mode=Mode.LEASE)
    async def leased(idem: Idempotency) -> dict[str, bool]:
        calls.n += 1
        return {"fenced": await idem.fenced_connection() is None}

    install(app, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


def started(sent: list[Any]) -> bool:
    return [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_a_connection_dependency_on_memory_store_fails_startup() -> None:
    sent = await startup(connection_app(MemoryStore(), Calls()))
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
    message = sent[0]["message"]
    for expected in (
        "POST /session declares ClaimSession",
        "POST /leased-session declares ClaimSession",
        "POST /own-sessions declares ClaimSession",
        "POST /raw declares IdempotencyConnection",
    ):
        assert f"{expected} {NO_CONNECTION}" in message, message
    assert message.count(NO_CONNECTION) == 4, message
    assert "app.dependency_overrides" in message
    assert "/context" not in message


async def test_without_lifespan_the_first_request_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As for every failed startup check: logged once, and every guarded request refused before
    any handler runs (the one taking only the context too, which ran before)."""
    calls = Calls()
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        async with client(connection_app(MemoryStore(), calls)) as c:
            for _ in range(2):
                assert (await c.post("/raw", headers=key("a"))).status_code == 500
                assert (await c.post("/context", headers=key("b"))).status_code == 500
    assert calls.n == 0
    errors = [m for m in messages(caplog, logging.ERROR) if NO_CONNECTION in m]
    assert len(errors) == 1, errors
    assert f"POST /raw declares IdempotencyConnection {NO_CONNECTION}" in errors[0]


async def test_the_context_alone_runs_on_memory_store() -> None:
    assert started(await startup(context_app(Calls())))
    calls = Calls()
    async with client(context_app(calls)) as c:
        first = await c.post("/context", headers=key("k"))
        assert first.status_code == 200, first.text
        assert_replay_of(await c.post("/context", headers=key("k")), first)
        leased = await c.post("/leased", headers=key("k"))
        assert leased.status_code == 200, leased.text
        assert leased.json() == {"fenced": True}  # (MemoryStore's fenced connection: None)
    assert calls.n == 2


async def test_an_overridden_connection_dependency_runs_on_memory_store() -> None:
    """A unit test may give the handler a session or connection of its own: then the claim's is
    never asked for, and the app starts and serves on MemoryStore."""
    sessions_only = connection_app(MemoryStore(), Calls())
    sessions_only.dependency_overrides[claim_session] = lambda: "session"
    sessions_only.dependency_overrides[SESSIONS.dependency] = lambda: "session"
    sent = await startup(sessions_only)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
    message = sent[0]["message"]  # only the connection still taken from the claim is refused
    assert message.count(NO_CONNECTION) == 1, message
    assert f"POST /raw declares IdempotencyConnection {NO_CONNECTION}" in message

    def overridden(calls: Calls) -> FastAPI:
        app = connection_app(MemoryStore(), calls)
        app.dependency_overrides[claim_session] = lambda: "session"
        app.dependency_overrides[SESSIONS.dependency] = lambda: "session"
        app.dependency_overrides[transaction_connection] = lambda: "connection"
        return app

    assert started(await startup(overridden(Calls())))
    calls = Calls()
    async with client(overridden(calls)) as c:
        for path in ("/session", "/leased-session", "/own-sessions", "/raw", "/context"):
            response = await c.post(path, headers=key(path))
            assert response.status_code == 200, (path, response.text)
    assert calls.n == 5


async def test_connection_dependencies_start_on_postgres(pg_store: PostgresStore) -> None:
    assert started(await startup(connection_app(pg_store, Calls())))
