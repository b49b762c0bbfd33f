"""The store's own statements on a session's connection go to the connection behind the pool's
proxy: each call through asyncpg's proxy is a Python function more (it checks the proxy was not
released, then calls the connection's method), several per request on the fast path. The handler
still gets the proxy, which goes dead when the connection goes back to the pool."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg
import pytest
from asyncpg.pool import PoolConnectionProxy
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, get_context
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State, StoredResponse
from tests.apps import client, key, one_route_app

#: The connection methods the fast path uses (a message, the settings, the transaction state).
_METHODS = (
    "execute",
    "fetch",
    "fetchrow",
    "fetchval",
    "get_settings",
    "get_reset_query",
    "is_in_transaction",
    "transaction",
)

kept: list[Any] = []


async def quiet(request: Request) -> Response:
    """Touches no connection: whatever goes through the proxy is the store's."""
    ctx = get_context(request)
    kept.append(ctx.connection if ctx.mode is Mode.TRANSACTIONAL else None)
    return JSONResponse({"ok": True}, status_code=201)


@contextmanager
def _proxy_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    calls: Counter[str] = Counter()
    for name in _METHODS:
        method = getattr(PoolConnectionProxy, name)

        def counted(self: Any, *args: Any, __name: str = name, __m: Any = method, **kw: Any) -> Any:
            calls[__name] += 1
            return __m(self, *args, **kw)

        monkeypatch.setattr(PoolConnectionProxy, name, counted)
    yield calls


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_the_fast_path_sends_its_statements_past_the_pools_proxy(
    db_dsn: str, mode: Mode, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept.clear()
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2)
    app = one_route_app("/quiet", quiet, store=store, default_policy=Policy(mode=mode))
    async with store, client(app) as c:
        await c.post("/quiet", json={}, headers=key("raw-warm"))  # (prepares its statements)
        with _proxy_calls(monkeypatch) as calls:
            first = await c.post("/quiet", json={}, headers=key(f"raw-{mode}"))
            again = await c.post("/quiet", json={}, headers=key(f"raw-{mode}"))
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert calls == Counter()
    if mode is Mode.TRANSACTIONAL:
        # The handler had the proxy, and it is dead now that its connection is back in the pool.
        with pytest.raises(asyncpg.InterfaceError):
            await kept[-1].fetchval("SELECT 1")


async def test_a_fenced_settlement_on_a_connection_given_back_reports_the_release(
    db_dsn: str,
) -> None:
    """The fast path sends on the connection behind the proxy only while the session holds it:
    once the proxy was given back (a handler that released it itself), the settlement takes the
    ordinary path, whose call through the proxy reports the release, and nothing is settled."""
    key = RecordKey("t1", "POST /pay", "given-back")
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2) as store:
        claim = await store.claim_lease(key, b"f", retention_seconds=60, lease_seconds=30)
        assert isinstance(claim, Claimed)

        settling: list[BaseException] = []  # what the settlement itself raised

        async def settle_given_back() -> None:
            async with store.fenced(key, claim.generation) as session:
                await store.pool.release(session.connection)
                try:
                    await session.settle(
                        Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
                    )
                except Exception as exc:
                    settling.append(exc)
                    raise

        # (On the way out the fence's rollback may say it too, in asyncpg's words.)
        with pytest.raises((StoreError, asyncpg.InterfaceError), match="released back to the pool"):
            await settle_given_back()
        [error] = settling
        assert isinstance(error, StoreError)
        assert "released back to the pool" in str(error)
        record = await store.get(key)
    assert record is not None
    assert record.state is State.PENDING


async def test_a_handler_that_gives_its_connection_back_records_nothing(db_dsn: str) -> None:
    """A handler that hands the claim's connection back to the pool itself (the pool rolls its
    transaction back, the handler's write with it) must not have its outcome recorded: the
    completion goes past the proxy only while the session holds the connection, so it cannot
    run outside that transaction, or in the transaction of whoever takes the connection next."""
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1)

    async def gives_back(request: Request) -> Response:
        conn = get_context(request).connection
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('t', 'given-back', 1)"
        )
        await store.pool.release(conn)
        return JSONResponse({"ok": True}, status_code=201)

    app = one_route_app("/gives-back", gives_back, store=store)
    async with store, client(app) as c:
        answer = await c.post("/gives-back", json={}, headers=key("gives-back"))
        rows = await store.pool.fetchval(
            "SELECT count(*) FROM test_ledger WHERE account_id = 'given-back'"
        )
        recorded = await store.pool.fetchval(
            "SELECT count(*) FROM idem_requests WHERE idem_key = 'gives-back'"
        )
    assert rows == 0  # the pool rolled the handler's write back
    assert recorded == 0
    assert answer.status_code >= 500
