"""One fenced transaction per execution, whoever asks for it and when.

Found by attacking lease mode: a handler whose helpers ran under `asyncio.gather`, each awaiting
`fenced_connection()`, opened two fenced transactions; the second waited (inside PostgreSQL, or
on the in-memory twin's row lock) for the first, which commits only when the handler ends. The
request never finished, and its record stayed pending and locked: retries got 409, `reconcile`
counted it held, `resolve` refused it. Concurrent callers now share the one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse

from idem_middleware import MemoryStore, Mode, Policy, PostgresStore, get_context
from idem_middleware.store import RecordKey, State
from tests.apps import client, key
from tests.apps.clients import one_route_app

LEDGER_INSERT = "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, $2, $3)"


@pytest.mark.parametrize("store", ["memory", "postgres"], indirect=True)
async def test_concurrent_calls_for_the_fenced_connection_share_one_transaction(
    store: MemoryStore | PostgresStore,
) -> None:
    connections: list[Any] = []
    opened: list[int] = []
    fenced_session = store.fenced

    @contextlib.asynccontextmanager
    async def counted(
        key: RecordKey, generation: int, expected: State = State.PENDING
    ) -> AsyncIterator[Any]:
        opened.append(generation)  # (the in-memory twin's connection is None: count sessions)
        await asyncio.sleep(0)  # (a round trip's pause, which the in-memory twin has not)
        async with fenced_session(key, generation, expected) as session:
            yield session

    store.fenced = counted  # type: ignore[method-assign]

    async def fenced(request: Request) -> Any:
        conn = await get_context(request).fenced_connection()
        connections.append(conn)
        return conn

    async def pay(request: Request) -> JSONResponse:
        # Both ask at once (one connection runs one statement at a time: the writes follow).
        first, second = await asyncio.gather(fenced(request), fenced(request))
        if first is not None:  # (the in-memory twin has no connection to write on)
            tenant = get_context(request).tenant
            await first.execute(LEDGER_INSERT, tenant, "fence", 1)
            await second.execute(LEDGER_INSERT, tenant, "fence", 2)
        return JSONResponse({"ok": True}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=1.0, wait_seconds=1.0)
    app = one_route_app("/pay", pay, store=store, default_policy=policy)
    async with store, client(app) as c:
        first = await asyncio.wait_for(c.post("/pay", json={}, headers=key("f1")), 30)
        again = await c.post("/pay", json={}, headers=key("f1"))
        record = await store.get(RecordKey("tenant-a", "POST /pay", "f1"))
        if isinstance(store, PostgresStore):
            written = await store.pool.fetchval(
                "SELECT count(*) FROM test_ledger WHERE account_id = 'fence'"
            )
            assert written == 2  # both writes, in the one fenced transaction, committed
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert len(connections) == 2
    assert connections[0] is connections[1]
    assert len(opened) == 1  # one fenced session for both callers
    assert record is not None
    assert record.state is State.SUCCEEDED
