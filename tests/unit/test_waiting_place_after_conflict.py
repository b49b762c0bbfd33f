"""Pinned: a transactional duplicate that waited, claimed, met a serialization failure and found
the key busy on its next attempt takes a waiting place again for its second wait
(transactional_wait.run_transactional: `place is None or not place.held`). It waited without
one: past `max_waiters`, duplicates waited unbounded in number.

The store is the in-memory one, its claims scripted: busy, claimed (the handler's write then
conflicts), busy, claimed."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.errors import ClaimBusy
from idem_middleware.store.memory.sessions import _MemoryTransaction
from idem_middleware.waiting import Waiters


class Conflicted(Exception):
    """What the database says of a handler's write that lost a serialization race."""


class ScriptedStore(MemoryStore):
    def __init__(self, script: list[str]) -> None:
        super().__init__()
        self.script = script
        self.waiting_at_claims: list[int] = []
        self.waiters: Waiters | None = None

    def transaction(self, *, acquire_timeout: float) -> Any:
        return _Scripted(self)


class _Scripted(_MemoryTransaction):
    def __init__(self, store: ScriptedStore) -> None:
        super().__init__(store)
        self.scripted = store

    def conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, Conflicted)

    async def claim(self, *args: Any, **options: Any) -> Any:
        store = self.scripted
        assert store.waiters is not None
        store.waiting_at_claims.append(store.waiters.count)
        if store.script.pop(0) == "busy":
            raise ClaimBusy("scripted: another request holds the key")
        return await super().claim(*args, **options)


async def test_a_second_wait_after_a_conflict_takes_a_waiting_place_again() -> None:
    runs = {"n": 0}

    async def pay(request: Request) -> JSONResponse:
        runs["n"] += 1
        if runs["n"] == 1:
            raise Conflicted("could not serialize access")
        return JSONResponse({"run": runs["n"]}, status_code=201)

    store = ScriptedStore(["busy", "claim", "busy", "claim"])
    mw = IdempotencyMiddleware(
        Starlette(routes=[Route("/pay", pay, methods=["POST"])]),
        store=store,
        default_policy=Policy(wait_seconds=30, max_serialization_retries=3),
        tenant_resolver=lambda scope: "tenant-a",
        max_waiters=1,
    )
    store.waiters = mw.waiters
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mw), base_url="http://test"
    ) as c:
        r = await asyncio.wait_for(c.post("/pay", json={}, headers={"idempotency-key": "k"}), 10)
    assert r.status_code == 201, r.text
    assert runs["n"] == 2
    # At each claim: not waiting yet; waiting (its place held); ran, its place given back;
    # waiting again, in a place of its own.
    assert store.waiting_at_claims == [0, 1, 0, 1]
    assert mw.waiters.count == 0
