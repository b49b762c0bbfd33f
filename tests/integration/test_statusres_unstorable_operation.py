"""The status resource's `operation` is the client's: one the database cannot carry (an emoji
or a euro sign in a LATIN1 database, or through a pool whose client encoding is LATIN1) names no
record, and is a `404 record-not-found`.

Found by probing: it was `500 server-misconfigured` ("the database cannot store its tenant,
operation or key... The server is misconfigured"), as for a tenant the database cannot carry,
which is the server's: any authenticated client could make the resource answer a server error
at will, with a query parameter. A tenant the database cannot carry is still the server's 500.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette

from idem_middleware import PostgresStore
from idem_middleware.status import status_route
from tests.apps import assert_problem, client
from tests.conftest import migrated_database

STATUS = "/idempotency/status"
UNCARRIED = ["POST /pay/\U0001f4a5", "POST /\u20ac", "POST api.\u20ac.example/pay"]


@pytest.fixture
async def latin1_dsn(admin_dsn: str) -> str:
    options = "ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    return await migrated_database(admin_dsn, "idem_statusres_latin1", options)


async def _lookups(store: PostgresStore, tenant: str, operations: list[str]) -> list[Any]:
    app = Starlette(routes=[status_route(store, tenant_resolver=lambda scope: tenant)])
    async with client(app) as c:
        return [await c.get(STATUS, params={"operation": op, "key": "k"}) for op in operations]


async def test_an_operation_a_latin1_database_cannot_store_is_not_found(latin1_dsn: str) -> None:
    async with PostgresStore(dsn=latin1_dsn) as store:
        answers = await _lookups(store, "tenant-a", ["POST /caf\u00e9", *UNCARRIED])
        # A tenant it cannot store is the server's misconfiguration, whatever the operation.
        [tenants] = await _lookups(store, "\u20ac-corp", UNCARRIED[:1])
    for answer in answers:
        assert_problem(answer, 404, "record-not-found")  # (was: 500 for all but `café`)
    assert_problem(tenants, 500, "server-misconfigured")


async def test_an_operation_the_client_encoding_cannot_carry_is_not_found(db_dsn: str) -> None:
    pool = await asyncpg.create_pool(
        db_dsn, min_size=1, max_size=2, server_settings={"client_encoding": "LATIN1"}
    )
    try:
        store = PostgresStore(pool=pool)
        answers = await _lookups(store, "tenant-a", UNCARRIED)
        [tenants] = await _lookups(store, "\u6771\u4eac", UNCARRIED[:1])
    finally:
        await pool.close()
    for answer in answers:
        assert_problem(answer, 404, "record-not-found")
    assert_problem(tenants, 500, "server-misconfigured")
