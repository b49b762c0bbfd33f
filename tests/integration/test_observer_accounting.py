"""Every guarded request is counted once, as what became of it: a waiting duplicate's busy key is
no error in a trace, a request that ends before any decision is `cancelled`, a refusal before the
exchange is `rejected`, a settlement the store could not make is `error` whether or not the
response streams, and a lease-mode execution that lost its claim ends its own claim (`stale`,
with its generation), not as a duplicate's `in_flight`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idem_middleware import (
    IdempotencyMiddleware,
    LeaseExpiry,
    MemoryStore,
    Mode,
    Policy,
    idempotent,
)
from idem_middleware.errors import StoreError
from idem_middleware.otel import OpenTelemetryObserver
from idem_middleware.store.memory import sessions
from tests.apps import BearerBackend, client


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, event: Any, attributes: Any) -> None:
        self.events.append((event.value, dict(attributes)))

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Any) -> Iterator[None]:
        yield

    def outcomes(self) -> list[str]:
        return [outcome for outcome, _ in self.events]


def app_with(
    routes: list[Route], observer: Any, *, authenticated: bool = True, **options: Any
) -> Starlette:
    middleware = [Middleware(AuthenticationMiddleware, backend=BearerBackend())]
    middleware = middleware if authenticated else []
    options.setdefault("store", MemoryStore())
    middleware.append(Middleware(IdempotencyMiddleware, observers=[observer], **options))
    return Starlette(routes=routes, middleware=middleware)


def scope(path: str, key: str, method: str = "POST") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"authorization", b"Bearer demo-a"),
            (b"idempotency-key", key.encode()),
            (b"content-type", b"application/json"),
        ],
        "client": ("127.0.0.1", 5),
        "server": ("test", 80),
    }


async def call(app: Any, request: dict[str, Any], *, leaves: bool = False) -> list[Any]:
    """Drives `app` as a server would; the client leaves after its body if `leaves`."""
    sent: list[Any] = []
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        if leaves:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        sent.append(message)

    with contextlib.suppress(asyncio.CancelledError):
        await app(request, receive, send)
    return sent


def status_of(sent: list[Any]) -> int | None:
    return next((m["status"] for m in sent if m["type"] == "http.response.start"), None)


def gated() -> tuple[asyncio.Event, Any]:
    gate = asyncio.Event()

    async def slow(request: Request) -> Response:
        await request.body()
        await gate.wait()
        return JSONResponse({"ok": 1}, 201)

    return gate, slow


async def test_a_waiting_duplicate_leaves_no_error_span_and_a_failing_claim_does() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gate, slow = gated()
    # Two apps on one store, as two processes: the duplicate's claim finds the key busy in the
    # store (a duplicate of a request of its own process waits without asking the store).
    store, observer = MemoryStore(), OpenTelemetryObserver(provider)
    app = app_with([Route("/slow", slow, methods=["POST"])], observer, store=store)
    other = app_with([Route("/slow", slow, methods=["POST"])], observer, store=store)
    async with client(app) as c, client(other) as c2:
        headers = {"idempotency-key": "k"}
        original = asyncio.ensure_future(c.post("/slow", json={}, headers=headers))
        await asyncio.sleep(0.05)
        duplicate = asyncio.ensure_future(c2.post("/slow", json={}, headers=headers))
        await asyncio.sleep(0.1)
        gate.set()
        assert (await original).status_code == 201
        assert (await duplicate).status_code == 201
    claims = [s for s in exporter.get_finished_spans() if s.name == "idem.claim"]
    assert len(claims) == 2  # the original's and the duplicate's first (busy) claim
    assert all(span.status.status_code is not StatusCode.ERROR for span in claims)
    assert not any(event.name == "exception" for span in claims for event in span.events)


async def test_a_claim_that_fails_is_still_an_error_span(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def unreachable(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise StoreError("connection lost")

    monkeypatch.setattr(sessions._MemoryTransaction, "claim", unreachable)
    _, slow = gated()
    app = app_with([Route("/slow", slow, methods=["POST"])], OpenTelemetryObserver(provider))
    async with client(app) as c:
        response = await c.post("/slow", json={}, headers={"idempotency-key": "k"})
    assert response.status_code == 503
    [claim] = [s for s in exporter.get_finished_spans() if s.name == "idem.claim"]
    assert claim.status.status_code is StatusCode.ERROR
    assert [e.attributes["exception.type"] for e in claim.events if e.attributes] == [
        "idem_middleware.errors.StoreError"
    ]


@pytest.mark.parametrize("how", ["cancelled", "client left"])
async def test_a_duplicate_that_ends_while_it_waits_is_counted_cancelled(how: str) -> None:
    recorder = Recorder()
    gate, slow = gated()
    app = app_with(
        [Route("/slow", slow, methods=["POST"])],
        recorder,
        default_policy=Policy(wait_seconds=5),
    )
    original = asyncio.ensure_future(call(app, scope("/slow", "k")))
    await asyncio.sleep(0.05)
    assert recorder.outcomes() == ["claimed"]
    duplicate = asyncio.ensure_future(call(app, scope("/slow", "k"), leaves=how == "client left"))
    await asyncio.sleep(0.1)
    if how == "cancelled":
        duplicate.cancel()
    sent = await asyncio.wait_for(duplicate, 5)
    assert status_of(sent) == (503 if how == "cancelled" else None)
    assert recorder.outcomes() == ["claimed", "cancelled"]
    gate.set()
    assert status_of(await original) == 201
    assert recorder.outcomes() == ["claimed", "cancelled", "succeeded"]


async def test_refusals_before_the_exchange_are_counted_rejected() -> None:
    recorder = Recorder()

    class AnyMethod:  # an ASGI endpoint: its route takes any method
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    app = app_with([Route("/any", idempotent()(AnyMethod()))], recorder)
    sent = await call(app, scope("/any", "k", method="X" * 1100))  # no record can hold it
    assert status_of(sent) == 400
    assert recorder.events == [("rejected", {"operation": "OTHER"})]

    recorder = Recorder()
    _, slow = gated()
    app = app_with([Route("/slow", slow, methods=["POST"])], recorder, authenticated=False)
    sent = await call(app, scope("/slow", "k"))  # no authentication names the caller
    assert status_of(sent) == 500
    assert recorder.events == [("rejected", {"operation": "POST /slow"})]


async def test_a_settlement_the_store_cannot_make_is_an_error_streamed_or_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def lost(self: Any, *args: Any, **kwargs: Any) -> None:
        raise StoreError("connection lost")

    monkeypatch.setattr(sessions._MemoryTransaction, "finish", lost)

    async def held(request: Request) -> Response:
        await request.body()
        return JSONResponse({"ok": 1}, 201)

    async def streamed(request: Request) -> Response:
        await request.body()

        async def chunks() -> Any:
            yield b"a"
            yield b"b"

        return StreamingResponse(chunks(), status_code=201, media_type="text/event-stream")

    routes = [Route("/held", held, methods=["POST"]), Route("/stream", streamed, methods=["POST"])]
    for path in ("/held", "/stream"):
        recorder = Recorder()
        app = app_with(routes, recorder)
        async with client(app) as c:
            response = await c.post(path, json={}, headers={"idempotency-key": path})
        assert response.status_code == 503, path
        assert recorder.outcomes() == ["claimed", "error"], path


async def test_an_execution_that_lost_its_claim_ends_it_as_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = Recorder()
    store = MemoryStore()

    async def lapses(*args: Any, **kwargs: Any) -> bool:
        return False  # every renewal fails: the first execution's lease lapses

    monkeypatch.setattr(store, "heartbeat", lapses)
    runs = 0

    async def handler(request: Request) -> Response:
        nonlocal runs
        await request.body()
        runs += 1
        if runs == 1:
            await asyncio.sleep(1.0)
        return JSONResponse({"ok": 1}, 201)

    policy = Policy(
        mode=Mode.LEASE,
        lease_seconds=0.3,
        wait_seconds=0.1,
        on_lease_expiry=LeaseExpiry.TAKEOVER,
    )
    app = app_with(
        [Route("/h", handler, methods=["POST"])], recorder, store=store, default_policy=policy
    )
    async with client(app) as c:
        first = asyncio.ensure_future(c.post("/h", json={}, headers={"idempotency-key": "k"}))
        await asyncio.sleep(0.5)
        retry = await c.post("/h", json={}, headers={"idempotency-key": "k"})
        assert retry.status_code == 201
        assert (await first).status_code == 409
    counted = [(outcome, attributes.get("generation")) for outcome, attributes in recorder.events]
    assert counted == [("claimed", 1), ("claimed", 2), ("succeeded", 2), ("stale", 1)]
