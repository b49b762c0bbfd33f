"""Responses that cannot be held (streams, over the cap) settle early: a refused early settlement
stops the response before its first byte, and nothing after the first byte runs the attempt again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, LeaseExpiry, Policy, PostgresStore, get_context
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    BearerBackend,
    Step,
    assert_problem,
    build_lease_app,
    client,
)
from tests.integration.test_lease_mode import (
    PausedHeartbeatStore,
    bank,  # noqa: F401 (a fixture)
    finish,
    lease_lapsed,
    post,
    probe_of,
    row,
    spawn,
)


@pytest.mark.parametrize("how", ["stream", "over-cap"])
async def test_a_stale_executor_never_streams_a_response_that_is_not_the_stored_outcome(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
    how: str,
) -> None:
    """A claims and is paused past its lease; B takes over and stores 402; A resumes and answers
    with a response that cannot be held. Its early settlement is refused, so A's client gets the
    same 409 a held response gets, not a 200 the record contradicts."""
    policy = LEASE_POLICY.replace(lease_seconds=0.6, on_lease_expiry=LeaseExpiry.TAKEOVER)
    if how == "over-cap":
        policy = policy.replace(max_response_bytes=10)
    async with PausedHeartbeatStore(pool=pool, listen=False) as paused:
        app_a = build_lease_app(paused, bank, policy)
        app_b = build_lease_app(pg_store, bank, policy)
        probe_a, probe_b = probe_of(app_a), probe_of(app_b)
        gate = asyncio.Event()
        probe_a.steps = [Step(gate=gate, status=200, stream=how == "stream")]
        probe_b.steps = [Step(status=402)]
        async with client(app_a) as ca, client(app_b) as cb:
            task_a = spawn(post(ca))
            await asyncio.wait_for(probe_a.entered.wait(), BOUND)
            await lease_lapsed(bank)
            b = await asyncio.wait_for(post(cb), BOUND)
            assert b.status_code == 402, b.text
            gate.set()
            a = await finish(task_a)
            assert_problem(a, 409, "request-in-flight")
            after = await row(bank)
            assert after is not None
            assert after["state"] == "failed_final"
            assert after["response_status"] == 402
            retry = await post(ca)
            assert retry.status_code == 402
            assert retry.headers["idempotent-replayed"] == "true"


class _Runs:
    def __init__(self) -> None:
        self.calls = 0


def _conflict_after_first_byte_app(store: PostgresStore, policy: Policy) -> Starlette:
    runs = _Runs()

    async def stream(request: Request) -> Response:
        runs.calls += 1
        get_context(request)  # it runs under a claim

        async def events() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            # Work while streaming meets a serialization failure (40001).
            raise asyncpg.exceptions.SerializationError("could not serialize access")

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(
        routes=[Route("/stream", stream, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=policy),
        ],
    )
    app.state.runs = runs
    return app


async def test_a_serialization_failure_after_the_first_byte_never_runs_the_attempt_again(
    pg_store: PostgresStore,
) -> None:
    """After an early (streaming) settlement the response has started: a 40001 the handler raises
    later must not re-run the attempt (a second execution, and a second response start)."""
    app = _conflict_after_first_byte_app(pg_store, Policy(max_serialization_retries=3))
    sent: list[dict[str, Any]] = []
    body = b"{}"
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/stream",
        "raw_path": b"/stream",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"test"),
            (b"authorization", b"Bearer demo-a"),
            (b"idempotency-key", b'"k-stream-40001"'),
            (b"content-type", b"application/json"),
            (b"content-length", b"2"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    with pytest.raises(asyncpg.exceptions.SerializationError):
        await asyncio.wait_for(app(scope, receive, send), BOUND)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    assert starts[0]["status"] == 200
    assert app.state.runs.calls == 1
    record = await pg_store.pool.fetchrow(
        "SELECT state, response_status FROM idem_requests WHERE idem_key = $1", "k-stream-40001"
    )
    assert record is not None
    assert (record["state"], record["response_status"]) == ("succeeded", 200)
