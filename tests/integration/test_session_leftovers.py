"""Session state a handler leaves on the claim's connection that asyncpg's own reset
(`pg_advisory_unlock_all()`, `CLOSE ALL`, `UNLISTEN *`, `RESET ALL`) keeps: the role
(`RESET ALL` never resets it), temporary tables and the sequences' `currval`. The
store's pool gives none of it to the next request, another tenant's (found by probing: tenant
B's handler ran as the role tenant A's handler had `SET`, and read A's temporary table)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, get_context
from tests.apps import client, key, one_route_app

#: What tenant B's handler reports of its connection.
SEEN = (
    "SELECT current_user::text AS role, session_user::text AS login,"
    " (SELECT count(*) FROM pg_class WHERE relname = 'scratch' AND relpersistence = 't')"
    " AS temp_tables"
)


@pytest.fixture
async def role(db_dsn: str) -> AsyncIterator[str]:
    """A role with every privilege the store and the test tables need (so a handler running
    as it completes), dropped afterwards."""
    name = f"idem_tenant_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(db_dsn)
    try:
        await admin.execute(
            f"CREATE ROLE {name}; GRANT ALL ON ALL TABLES IN SCHEMA public TO {name};"
            f" GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {name};"
            f" GRANT {name} TO current_user"
        )
        yield name
    finally:
        await admin.execute(f"DROP OWNED BY {name}; DROP ROLE {name}")
        await admin.close()


async def _connection(request: Request) -> Any:
    ctx = get_context(request)
    return await ctx.fenced_connection() if ctx.mode is Mode.LEASE else ctx.connection


def _app(store: PostgresStore, mode: Mode, leave: str, seen: dict[str, Any]) -> Any:
    async def handler(request: Request) -> Response:
        conn = await _connection(request)
        if request.query_params.get("leave"):
            await conn.execute(
                "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('a', 'x', 1)"
            )
            await conn.execute("CREATE TEMP TABLE scratch AS SELECT 'tenant-a secret' AS secret")
            await conn.execute(leave)
        else:
            seen.update(await conn.fetchrow(SEEN))
            try:
                async with conn.transaction():  # (a savepoint: its error is only its own)
                    seen["currval"] = await conn.fetchval("SELECT currval('test_ledger_id_seq')")
            except asyncpg.ObjectNotInPrerequisiteStateError:
                seen["currval"] = None
        return JSONResponse({}, status_code=201)

    return one_route_app("/x", handler, store=store, default_policy=Policy(mode=mode))


@pytest.mark.parametrize("fast", [True, False], ids=["fused", "ordinary"])
@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("leave", ["SET ROLE {role}", "SET SESSION AUTHORIZATION {role}"])
async def test_the_next_request_gets_none_of_the_sessions_role_temp_tables_or_sequences(
    db_dsn: str, role: str, mode: Mode, fast: bool, leave: str
) -> None:
    seen: dict[str, Any] = {}
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False, fast_path=fast)
    app = _app(store, mode, leave.format(role=role), seen)
    async with store:
        login = await store.pool.fetchval("SELECT session_user::text")
        if leave.startswith("SET SESSION") and not await store.pool.fetchval(
            "SELECT rolsuper FROM pg_roles WHERE rolname = session_user"
        ):
            pytest.skip("SET SESSION AUTHORIZATION needs a superuser login")
        tag = f"{mode}-{fast}-{leave.split()[1]}"
        async with client(app, token="demo-a") as a:
            first = await a.post("/x?leave=1", json={}, headers=key(f"leave-{tag}"))
        async with client(app, token="demo-b") as b:  # the pool's only connection, again
            then = await b.post("/x", json={}, headers=key(f"see-{tag}"))
    assert (first.status_code, then.status_code) == (201, 201), (first.text, then.text)
    assert seen == {"role": login, "login": login, "temp_tables": 0, "currval": None}


async def test_the_reset_gives_a_connection_back_the_role_it_was_opened_with(
    db_dsn: str, role: str
) -> None:
    """A pool whose connections open under a role (`server_settings={"role": ...}`, or the
    login role's `ALTER ROLE ... SET role`) gets that role back, not the login's."""
    seen: dict[str, Any] = {}
    store = PostgresStore(
        dsn=db_dsn,
        min_size=1,
        max_size=1,
        listen=False,
        connect_kwargs={"server_settings": {"role": role}},
    )
    app = _app(store, Mode.TRANSACTIONAL, "RESET ROLE; SET ROLE NONE", seen)
    async with store:
        async with client(app, token="demo-a") as a:
            first = await a.post("/x?leave=1", json={}, headers=key("configured-leave"))
        async with client(app, token="demo-b") as b:
            then = await b.post("/x", json={}, headers=key("configured-see"))
    assert (first.status_code, then.status_code) == (201, 201), (first.text, then.text)
    assert seen["role"] == role
    assert seen["temp_tables"] == 0
