"""A lease-mode application that returns without sending a response (an ASGI app's bug): what
it did outside the database may have happened, so its record is marked `unknown` and the server
is told (a 500), as for a handler that raises; the mark is sent again on a blip, and a handler
that declared it did nothing releases the key instead."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, Mode, Outcome, Policy, get_context
from idem_middleware.errors import StoreError
from idem_middleware.store.base import RecordKey, Settlement, State, Store
from tests.apps import BearerBackend, client, key

KEY = RecordKey("tenant-a", "POST /silent", "k1")


class Silent:
    """An ASGI endpoint that reads its request and sends nothing; `declare`: its outcome."""

    def __init__(self, declare: Outcome | None = None) -> None:
        self.declare = declare
        self.runs = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runs += 1
        await receive()
        if self.declare is not None:
            get_context(scope).declare(self.declare)


def silent_app(store: Store, endpoint: Silent) -> Starlette:
    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=0.2)
    return Starlette(
        routes=[Route("/silent", endpoint, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, policies={"POST /silent": policy}),
        ],
    )


@pytest.mark.parametrize("blip", [False, True], ids=["marked", "marked-after-a-blip"])
async def test_a_handler_that_sends_nothing_leaves_its_record_unknown(
    store: Store, monkeypatch: pytest.MonkeyPatch, blip: bool
) -> None:
    marks: list[State] = []
    real_settle = store.settle

    async def settle(key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        marks.append(s.state)
        if blip and len(marks) == 1:
            raise StoreError("ConnectionDoesNotExistError: connection was closed")
        return await real_settle(key, generation, expected, s)

    monkeypatch.setattr(store, "settle", settle)
    endpoint = Silent()
    async with client(silent_app(store, endpoint)) as c:
        first = await c.post("/silent", json={}, headers=key("k1"))
        retry = await c.post("/silent", json={}, headers=key("k1"))
    assert first.status_code == 500
    assert retry.status_code == 409
    assert retry.json()["type"].endswith("outcome-unknown")
    record = await store.get(KEY)
    assert record is not None
    assert record.state is State.UNKNOWN
    assert endpoint.runs == 1
    assert marks == [State.UNKNOWN] * (2 if blip else 1)


async def test_a_handler_that_declared_it_did_nothing_releases_the_key(store: Store) -> None:
    endpoint = Silent(declare=Outcome.RELEASE)
    async with client(silent_app(store, endpoint)) as c:
        first = await c.post("/silent", json={}, headers=key("k1"))
        assert first.status_code == 500
        assert await store.get(KEY) is None  # free for a retry: nothing happened
        await c.post("/silent", json={}, headers=key("k1"))
    assert endpoint.runs == 2
