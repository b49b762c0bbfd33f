"""A handler that executes a prepared statement of its own naming that does not exist (26000,
the error a statement dropped under the store also raises) gets its own error after one run:
taken for a statement asyncpg or the store prepared and lost, the attempt ran again, four runs
in all. A statement of asyncpg's dropped by the handler (DEALLOCATE ALL) still runs again once
the connection's cache is emptied (tests/integration/test_fused.py and its neighbours)."""

from __future__ import annotations

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import PostgresStore, get_context
from tests.apps import client, key, one_route_app

_runs: list[str] = []


async def own_plan(request: Request) -> Response:
    ctx = get_context(request)
    _runs.append(ctx.key)
    await ctx.connection.execute("EXECUTE never_prepared_by_anyone")
    return JSONResponse({}, status_code=201)


@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_handlers_own_missing_statement_runs_once(db_dsn: str, fast_path: bool) -> None:
    _runs.clear()
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    name = f"own-missing-statement-{fast_path}"
    async with store, client(one_route_app("/own", own_plan, store=store)) as c:
        r = await c.post("/own", json={}, headers=key(name))
    assert r.status_code == 500, r.text
    assert _runs == [name]
