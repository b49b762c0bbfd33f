"""The example app's own database reads when PostgreSQL ends its idle connections (a restart).

Found by a soak (mixed traffic, PostgreSQL restarted in the middle): at the moment the server
shut down, `GET /accounts/{id}` answered a bare text/plain 500. The pool handed out a connection
whose server had already sent "terminating connection due to administrator command" but whose
socket asyncpg had not yet seen close, and asyncpg raised InternalClientError ("cannot switch
to state 12; another operation (2) is in progress"), which the app's DATABASE_DOWN lacked (the
store's own list has it). Documented: a 503 problem with `Retry-After` while the database is away.
"""

from __future__ import annotations

import collections
import uuid

import asyncpg
import httpx
import pytest

from tests.conftest import _fresh_database

A = {"authorization": "Bearer demo-a"}
ROUNDS = 30


async def test_a_read_on_a_connection_the_server_just_ended_is_a_503_problem(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from example_app.app import create_app
    from example_app.database import prepare

    monkeypatch.setenv("EXAMPLE_PUBLISH", "0")
    name = f"idem_soak_{uuid.uuid4().hex[:8]}"
    dsn = await _fresh_database(pg_dsn, name)
    await prepare(dsn)
    app = create_app(dsn)
    seen: collections.Counter[int] = collections.Counter()
    admin = await asyncpg.connect(dsn)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t") as c,
        ):
            for _ in range(ROUNDS):
                warm = await c.get("/accounts/acc-1", headers=A)  # a pooled connection, idle
                assert warm.status_code in (404, 503), warm.text
                # The server ends the pool's idle sessions, as a fast shutdown does; the next
                # read takes one of them at once, before its socket is seen closed.
                await admin.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND state = 'idle' AND backend_type = 'client backend'"
                )
                r = await c.get("/accounts/acc-1", headers=A)
                seen[r.status_code] += 1
                assert r.status_code in (404, 503), r.text  # (before: a text/plain 500)
                if r.status_code == 503:
                    assert r.headers["content-type"] == "application/problem+json"
                    assert r.headers["retry-after"] == "1"
                if seen[503] >= 3:
                    break
    finally:
        await admin.close()
        cleanup = await asyncpg.connect(pg_dsn)
        try:
            await cleanup.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        finally:
            await cleanup.close()
    assert seen[503], f"the ended connection was never met: {dict(seen)}"
