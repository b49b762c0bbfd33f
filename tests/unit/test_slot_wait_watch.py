"""A lease-mode duplicate waiting for its tenant's slot watches its client, as its wait does.

Found by probing: a duplicate whose key was released by its original (in another process) went
on to take it over, but its tenant's slots there were all busy, and it waited for one with a
plain sleep. Its client left meanwhile: it kept its `max_waiters` place, and once a slot freed
it took the key over and ran the handler for a client that was gone. It now stops at once: its
place goes back, nothing is claimed and nothing runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from tests.apps import BOUND, until
from tests.apps.clients import post_scope

pytestmark = pytest.mark.asyncio


async def _post(app: Any, key: bytes, gone: asyncio.Event | None = None) -> list[Any]:
    """The messages sent for one request; its client leaves when `gone` is set."""
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"b", "more_body": False}
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [(b"host", b"x"), (b"idempotency-key", key), (b"content-type", b"text/plain")]
    await app(post_scope("/pay", headers), receive, send)
    return sent


async def test_a_duplicate_whose_client_leaves_while_it_waits_for_a_slot_runs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from idem_middleware.lease import LeaseRun

    waiting_for_a_slot = asyncio.Event()
    slot_by = LeaseRun._slot_by

    async def spied(run: LeaseRun, deadline: float) -> Any:
        waiting_for_a_slot.set()  # (only the duplicate asks, and its process's slots are taken)
        return await slot_by(run, deadline)

    monkeypatch.setattr(LeaseRun, "_slot_by", spied)
    runs: list[tuple[str, bytes]] = []
    release, fillers_done = asyncio.Event(), asyncio.Event()

    async def pay(request: Request) -> Response:
        key = request.headers["idempotency-key"].encode()
        runs.append((request.app.state.name, key))
        if key == b"K":
            await release.wait()
            return Response(b"", status_code=429)  # nothing happened: the key is released
        await fillers_done.wait()
        return Response(b"", status_code=201)

    store = MemoryStore()
    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=30.0)
    middlewares: dict[str, IdempotencyMiddleware] = {}

    def process(name: str) -> IdempotencyMiddleware:  # (one process's middleware and slots)
        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        app.state.name = name
        middlewares[name] = IdempotencyMiddleware(
            app,
            store=store,
            default_policy=policy,
            tenant_resolver=lambda scope: "tenant-a",
            max_tenant_connections=3,
        )
        return middlewares[name]

    one, two = process("one"), process("two")
    original = asyncio.ensure_future(_post(one, b"K"))
    await until(lambda: runs == [("one", b"K")])
    gone = asyncio.Event()
    duplicate = asyncio.ensure_future(_post(two, b"K", gone))
    await until(lambda: middlewares["two"].waiters.count == 1)
    fillers = [asyncio.ensure_future(_post(two, b"F%d" % i)) for i in range(3)]
    await until(lambda: len(runs) == 4)  # the second process's three slots are all taken
    release.set()  # the key is released: the duplicate goes on to take it over, and waits
    assert (await asyncio.wait_for(original, BOUND))[0]["status"] == 429
    await asyncio.wait_for(waiting_for_a_slot.wait(), BOUND)
    assert middlewares["two"].waiters.count == 1  # (it holds its place meanwhile)
    assert not duplicate.done()
    gone.set()
    assert await asyncio.wait_for(duplicate, BOUND) == []  # nothing sent to a client gone
    assert middlewares["two"].waiters.count == 0
    fillers_done.set()
    await asyncio.wait_for(asyncio.gather(*fillers), BOUND)
    assert ("two", b"K") not in runs  # no handler ran for the client that left
