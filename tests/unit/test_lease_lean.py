"""Lease mode's own per-request work, pinned where a cut made it smaller
(docs/performance-history.md, "Lease mode's own work"): each would come back unnoticed, since
nothing else fails with it."""

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


async def test_a_fresh_requests_handler_has_one_frame_of_lease_mode_above_it() -> None:
    """The execution claims the key in its own frame: between the exchange and the handler
    there is `LeaseExecution.run` alone (each await of the handler passes every frame above it),
    and a fresh request still holds its claim (the handler sees its generation)."""
    seen: list[str] = []

    async def handler(request: Request) -> Response:
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename.rsplit("/", 1)[-1]
            if name in ("exchange.py", "lease.py", "lease_executor.py"):
                seen.append(f"{name}:{frame.f_code.co_name}")
            frame = frame.f_back
        return JSONResponse({"ok": True}, status_code=201)

    app = one_route_app(
        "/pay", handler, store=MemoryStore(), default_policy=Policy(mode=Mode.LEASE)
    )
    async with client(app) as c:
        first = await c.post("/pay", json={}, headers=key("frames-1"))
        again = await c.post("/pay", json={}, headers=key("frames-1"))
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert seen == ["lease_executor.py:run", "exchange.py:run"]  # once: the replay ran nothing
