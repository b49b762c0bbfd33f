"""What a request leaves behind once it is done, and whose it is while it runs (found by
probing a long-running process): a lease heartbeat runs as its own request, never as another.
"""

from __future__ import annotations

import asyncio
import contextvars

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware import Mode, Policy
from idem_middleware.store import MemoryStore
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State, StoredResponse
from tests.apps import BOUND, client, key, one_route_app

#: An outer middleware's per-request value (a request id a log filter reads, a trace span).
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")


class RequestIds:
    """Sets REQUEST_ID to the request's path, as a correlation-id middleware would."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            REQUEST_ID.set(scope["path"])
        await self.app(scope, receive, send)


class HeartbeatsSeen(MemoryStore):
    """Notes the request id each lease renewal runs under."""

    def __init__(self) -> None:
        super().__init__()
        self.renewals: list[tuple[str, str | None]] = []

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.renewals.append((key.key, REQUEST_ID.get(None)))
        return await super().heartbeat(key, generation, lease_seconds)


async def test_a_heartbeat_runs_in_its_own_requests_context() -> None:
    """The heartbeat was started by the renewal timer all lease executions share, in the context
    of whichever request had armed that timer: a long request's renewals ran as an earlier
    request, finished long before (its request id in their logs, their spans in its trace)."""
    store = HeartbeatsSeen()
    slow: dict[str, float] = {}

    async def handler(request: Request) -> Response:
        await request.body()
        await asyncio.sleep(slow.get(request.url.path, 0.0))
        return JSONResponse({}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=0.15, wait_seconds=1.0)
    app = one_route_app("/{name}", handler, store=store, default_policy=policy)
    app.add_middleware(RequestIds)
    slow["/slow"] = 0.4  # past a third of its lease: it renews
    async with client(app) as http:
        quick = await asyncio.wait_for(http.post("/quick", json={}, headers=key("q")), BOUND)
        long = await asyncio.wait_for(http.post("/slow", json={}, headers=key("s")), BOUND)
    assert (quick.status_code, long.status_code) == (201, 201)
    assert store.renewals, "the slow request renewed its lease"
    assert set(store.renewals) == {("s", "/slow")}


async def test_the_memory_stores_row_locks_go_when_nobody_holds_them() -> None:
    """Every key a lease-mode request (its settlement, a heartbeat, a fenced session) or an
    operator touched kept its row lock in MemoryStore for good, past its record's purge: a
    process serving 20,000 lease requests held 20,000 locks and keys."""
    store = MemoryStore()
    for n in range(50):
        key = RecordKey("t", "POST /pay", f"k{n}")
        claim = await store.claim_lease(key, b"f", retention_seconds=60, lease_seconds=30)
        assert isinstance(claim, Claimed)
        assert await store.heartbeat(key, claim.generation, 30)
        async with store.fenced(key, claim.generation) as session:
            assert await session.settle(Settlement(State.SUCCEEDED, StoredResponse(201, [], b"")))
    assert store._fence_locks == {}

    # Held, waited for, and a waiter cancelled: the lock still excludes, and goes with the last.
    key = RecordKey("t", "POST /pay", "contended")
    claim = await store.claim_lease(key, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)

    async def fence_again() -> bool:
        async with store.fenced(key, claim.generation):
            return True

    async with store.fenced(key, claim.generation):
        # (Renewals, expiries and takeovers never wait for it: see queries.sql `heartbeat`,
        # `expire_lease`, `takeover`. Another executor's fenced session does.)
        waiting = asyncio.ensure_future(fence_again())
        cancelled = asyncio.ensure_future(fence_again())
        await asyncio.sleep(0)
        assert not waiting.done()  # it waits for the fenced session's row lock
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert len(store._fence_locks) == 1
    assert await waiting
    assert store._fence_locks == {}
