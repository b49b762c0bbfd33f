"""A lease-mode application that returns half-way through its response, its client still there
(an ASGI app's bug: a body chunk with `more_body`, then nothing): the response is not complete,
so it is not the outcome. The record is marked `unknown` and the server is told (a 500), as for
an app that sends nothing; only a client that left cuts a response short into a recorded
outcome (lease_executor.py `run`: `capture.start is None or not ex.client_left()`)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, Mode, Policy
from idem_middleware.store.base import RecordKey, State, Store
from tests.apps import BearerBackend, client, key

KEY = RecordKey("tenant-a", "POST /half", "k1")


class Half:
    """An ASGI endpoint that starts a 201 and sends one chunk of more to come, then returns."""

    def __init__(self) -> None:
        self.runs = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runs += 1
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"id": ', "more_body": True})


def half_app(store: Store, endpoint: Half) -> Starlette:
    policy = Policy(mode=Mode.LEASE, lease_seconds=30.0, wait_seconds=0.2)
    return Starlette(
        routes=[Route("/half", endpoint, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, policies={"POST /half": policy}),
        ],
    )


async def test_a_response_left_half_sent_leaves_its_record_unknown(store: Store) -> None:
    endpoint = Half()
    async with client(half_app(store, endpoint)) as c:
        first = await c.post("/half", json={}, headers=key("k1"))
        retry = await c.post("/half", json={}, headers=key("k1"))
    assert first.status_code == 500
    assert retry.status_code == 409
    assert retry.json()["type"].endswith("outcome-unknown")
    record = await store.get(KEY)
    assert record is not None
    assert record.state is State.UNKNOWN  # not `succeeded` with its body omitted
    assert endpoint.runs == 1
