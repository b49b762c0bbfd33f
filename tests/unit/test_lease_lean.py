"""Lease mode's own per-request work, pinned where a cut made it smaller (docs/performance.md,
"Lease mode's own work"): each would come back unnoticed, since nothing else fails with it."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import MemoryStore, Mode, Policy
from idem_middleware.delayed import Delayed
from idem_middleware.lease_executor import LeaseExecution
from idem_middleware.store.postgres.runner import alone
from tests.apps import client, key, one_route_app


async def test_a_statement_run_alone_has_one_frame_of_the_store_above_it() -> None:
    callers: list[str] = []

    async def statement() -> int:
        callers.append(sys._getframe(1).f_code.co_name)
        callers.append(sys._getframe(2).f_code.co_name)
        return 7

    assert await alone(statement, on=None) == 7
    assert callers == ["alone", "test_a_statement_run_alone_has_one_frame_of_the_store_above_it"]


async def ok(request: Request) -> Response:
    return JSONResponse({"ok": True}, status_code=201)


async def test_an_executions_renewals_are_stopped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    discarded: list[Any] = []
    discard = Delayed.discard

    def counted(self: Delayed, item: Any) -> None:
        if isinstance(item, LeaseExecution):
            discarded.append(item)
        discard(self, item)

    monkeypatch.setattr(Delayed, "discard", counted)
    app = one_route_app("/pay", ok, store=MemoryStore(), default_policy=Policy(mode=Mode.LEASE))
    async with client(app) as c:
        first = await c.post("/pay", json={}, headers=key("lean-1"))
        again = await c.post("/pay", json={}, headers=key("lean-1"))
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert len(discarded) == 1  # the execution's, as its settlement starts; the replay has none


def test_an_asyncpg_without_the_private_release_parts_releases_the_ordinary_way() -> None:
    """`compat.release_unshielded` reaches into asyncpg's pool; one that keeps those parts
    elsewhere gets its own `pool.release` (None here), never an AttributeError per request."""
    from idem_middleware.store.postgres import compat

    class Pool:  # (no `_check_init`)
        pass

    class Holder:
        def __init__(self, pool: object) -> None:
            self._pool = pool

    class Proxy:
        def __init__(self, pool: object) -> None:
            self._holder = Holder(pool)
            self._con = object()  # (no `_on_release`)

    pool = Pool()
    assert compat.release_unshielded(pool, Proxy(pool)) is None
