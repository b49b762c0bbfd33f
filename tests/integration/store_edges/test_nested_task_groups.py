"""A conflict raised inside a task group nested in another (a helper's TaskGroup under the
handler's): an ExceptionGroup holding an ExceptionGroup. Every error in it, at any depth, is a
conflict, so the attempt runs again (convert.leaf_errors opens nested groups); a nested group
was taken as one error that is no conflict, and the request a 500."""

from __future__ import annotations

import asyncio

import asyncpg
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import PostgresStore, get_context
from tests.apps import LEDGER_INSERT, client, count, one_route_app
from tests.integration.test_task_groups import in_a_task_group, serialization_failure


async def test_a_conflict_inside_nested_task_groups_runs_the_attempt_again(
    pg_store: PostgresStore, pool: asyncpg.Pool
) -> None:
    runs: list[int] = []

    async def handler(request: Request) -> Response:
        connection = get_context(request).connection
        await connection.execute(LEDGER_INSERT, "tenant-a", "acc", 1)
        runs.append(1)
        if len(runs) == 1:
            async with asyncio.TaskGroup() as outer:
                outer.create_task(in_a_task_group(serialization_failure()))
        return JSONResponse({"runs": len(runs)}, status_code=201)

    app = one_route_app("/pay", handler, store=pg_store)
    async with client(app) as c:
        first = await c.post("/pay", json={}, headers={"Idempotency-Key": "nested"})
    assert first.status_code == 201, first.text
    assert len(runs) == 2
    assert await count(pool, "test_ledger") == 1  # the first attempt's write rolled back
