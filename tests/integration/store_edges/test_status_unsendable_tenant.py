"""The status resource's read of a tenant the pool's client encoding cannot carry (`東京` under
LATIN1): asyncpg refuses to send the parameter (its DataError from a UnicodeEncodeError), and
that is the server's `500 server-misconfigured` problem, as for the claim
(test_sql_safety.py), never a bare 500 with the driver's error and the tenant in its text
(convert.READ_TRANSLATED)."""

from __future__ import annotations

import asyncpg
from starlette.applications import Starlette

from idem_middleware import PostgresStore
from idem_middleware.status import status_route
from tests.apps import assert_problem, client


async def test_a_status_lookup_of_a_tenant_the_client_encoding_cannot_carry(db_dsn: str) -> None:
    pool = await asyncpg.create_pool(
        db_dsn, min_size=1, max_size=2, server_settings={"client_encoding": "LATIN1"}
    )
    try:
        store = PostgresStore(pool=pool)
        app = Starlette(routes=[status_route(store, tenant_resolver=lambda scope: "東京")])
        async with client(app) as c:
            r = await c.get(
                "/idempotency/status", params={"operation": "POST /charges", "key": "k"}
            )
        assert_problem(r, 500, "server-misconfigured")
        assert "東京" not in r.text
    finally:
        await pool.close()
