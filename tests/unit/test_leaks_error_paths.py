"""The error paths of a guarded request leave nothing for the cyclic garbage collector, as the
happy paths do (tests/unit/test_request_cycles.py): an error the request path keeps past its
`except` (a refused key, a busy key's ClaimBusy) held its own traceback, whose frames held the
error again and the request (its scope, its body): one cycle per refused request. And an app's
one HTTPException instance, raised by its tenant resolver or key function at every request and
answered by the middleware, no longer grows its traceback by each request's frames."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import MemoryStore, Policy
from idem_middleware.errors import RetryableConflict
from idem_middleware.keysource import KeyFromBody
from idem_middleware.policy import Mode
from tests.apps import one_route_app
from tests.cycles import collector_off
from tests.unit.test_request_cycles import _request

pytestmark = pytest.mark.asyncio


async def pay(request: Request) -> Response:
    if request.headers["idempotency-key"].startswith("conflict"):
        # (What the attempt raises when the database refuses the handler's writes.)
        raise RetryableConflict("could not serialize access")
    gate = request.app.state.gates.get(request.headers["idempotency-key"])
    if gate is not None:
        await gate.wait()
    return JSONResponse({"ok": True}, status_code=201)


def app_with(**options: Any) -> Any:
    policy = options.pop("policy", Policy())
    app = one_route_app("/pay", pay, store=MemoryStore(), default_policy=policy, **options)
    app.state.gates = {}
    return app


async def statuses_and_cycles(
    app: Any, keys: Callable[[int], str], body: bytes
) -> tuple[Any, list[str]]:
    """Requests to `app` (a few first, to warm its caches), then how many objects the cyclic
    collector found of the middleware's own that the counted ones left (tests.cycles)."""

    async def one(key: str) -> int:
        scope, receive, send, sent = _request("/pay", key)
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive_body() -> Any:
            return messages.pop() if messages else await receive()

        await app(scope, receive_body, send)
        status: int = sent[0]["status"]
        return status

    for i in range(3):
        await one(keys(-1 - i))
    statuses = set()
    with collector_off() as garbage:
        for i in range(10):
            statuses.add(await one(keys(i)))
    return statuses, garbage.ours


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_an_invalid_key_leaves_no_cycle(mode: Mode) -> None:
    app = app_with(policy=Policy(mode=mode))
    statuses, left = await statuses_and_cycles(app, lambda i: f"\x01bad{i}", b"{}")
    assert statuses == {400}
    assert left == []


def _refuse_freshly(scope: Any, body: bytes) -> str:
    raise HTTPException(403, "not yours")


def _shared_refusal() -> Callable[..., Any]:
    refusal = HTTPException(403, "not yours")

    def refuse(*args: Any) -> Any:
        raise refusal

    refuse.refusal = refusal  # type: ignore[attr-defined]
    return refuse


@pytest.mark.parametrize(
    ("source", "body", "status"),
    [
        (KeyFromBody("/id"), b"{not json", 400),  # body-invalid
        (KeyFromBody("/id"), b'{"other": 1}', 400),  # missing-key
        (_refuse_freshly, b"{}", 403),  # the key function's own refusal
    ],
    ids=["not-json", "no-member", "function-refuses"],
)
async def test_a_key_sources_refusal_leaves_no_cycle(source: Any, body: bytes, status: int) -> None:
    app = app_with(policy=Policy(key_source=source))
    statuses, left = await statuses_and_cycles(app, lambda i: f"k{i}", body)
    assert statuses == {status}
    assert left == []


def _traceback_length(exc: BaseException) -> int:
    tb, n = exc.__traceback__, 0
    while tb is not None and n < 10_000:
        tb, n = tb.tb_next, n + 1
    return n


@pytest.mark.parametrize("where", ["tenant_resolver", "key_source"])
async def test_one_http_exception_raised_at_every_request_keeps_no_request(where: str) -> None:
    """An app that raises one module-level HTTPException (FastAPI's `credentials_exception`,
    say) from its resolver or key function: each raise added the request's frames to its
    traceback, and the middleware, which answers it, kept them all alive."""
    refuse = _shared_refusal()
    options = {"tenant_resolver": refuse} if where == "tenant_resolver" else {}
    policy = Policy(key_source=refuse) if where == "key_source" else Policy()
    app = app_with(policy=policy, **options)
    statuses, left = await statuses_and_cycles(app, lambda i: f"k{i}", b"{}")
    assert statuses == {403}
    assert left == []
    assert _traceback_length(refuse.refusal) == 0  # type: ignore[attr-defined]


async def test_duplicates_of_a_running_request_leave_no_cycle() -> None:
    """Transactional duplicates answered 409 (the key busy past their wait): the ClaimBusy the
    exchange kept for the retry loop held its frame in a cycle."""
    app = app_with(policy=Policy(wait_seconds=0.0))
    gate = app.state.gates["held"] = asyncio.Event()
    scope, receive, send, sent = _request("/pay", "held")
    held = asyncio.ensure_future(app(scope, receive, send))
    for _ in range(100):  # (the held request claims in a few turns of the loop)
        await asyncio.sleep(0)
    assert not held.done()
    try:
        statuses, left = await statuses_and_cycles(app, lambda i: "held", b'{"amount": 5}')
    finally:
        gate.set()
        await held
    assert statuses == {409}
    assert left == []
    assert sent[0]["status"] == 201


async def test_a_request_whose_attempts_all_conflict_leaves_no_cycle() -> None:
    """Run again after each serialization failure, then answered 409: the last failure, kept
    by the retry loop, held its frame in a cycle."""
    app = app_with()
    statuses, left = await statuses_and_cycles(app, lambda i: f"conflict{i}", b"{}")
    assert statuses == {409}
    assert left == []
