"""Metrics, traces and logs after a scripted sequence: one claim, one replay, one mismatch and one
request in flight."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy, idempotent
from idem_middleware.errors import ConfigurationError
from idem_middleware.observe import LoggingObserver
from idem_middleware.otel import MAX_ATTRIBUTE_CHARS, OpenTelemetryObserver
from idem_middleware.prometheus import MAX_LABEL_CHARS, PrometheusObserver
from tests.apps import BearerBackend, build_app, client, post_scope

OP = "POST /accounts/{account_id}/credits"
SECRET_KEY = "raw-key-that-must-not-be-logged"


async def scripted(app: Any) -> list[int]:
    """claim; replay; mismatch; and a duplicate that finds the original still in flight."""
    probe = app.state.probe
    statuses = []
    async with client(app) as c:
        url = "/accounts/obs/credits"
        headers = {"idempotency-key": SECRET_KEY}
        statuses.append((await c.post(url, json={"amount": 1}, headers=headers)).status_code)
        statuses.append((await c.post(url, json={"amount": 1}, headers=headers)).status_code)
        statuses.append((await c.post(url, json={"amount": 2}, headers=headers)).status_code)
        probe.gate = asyncio.Event()
        # (Set by the first request: left set, the duplicate below could claim first and wait on
        # the gate for ever; Python 3.12's wait_for does not yield for a done awaitable.)
        probe.entered.clear()
        held = asyncio.ensure_future(
            c.post(url, json={"amount": 3}, headers={"idempotency-key": "second"})
        )
        await asyncio.wait_for(probe.entered.wait(), 5)
        probe.entered.clear()
        duplicate = await c.post(url, json={"amount": 3}, headers={"idempotency-key": "second"})
        statuses.append(duplicate.status_code)
        probe.gate.set()
        await asyncio.wait_for(held, 5)
    return statuses


def counter(registry: CollectorRegistry, outcome: str) -> float:
    value = registry.get_sample_value("idem_requests_total", {"operation": OP, "outcome": outcome})
    return value or 0.0


async def test_prometheus_counts_each_outcome(pg_store: Any) -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry=registry)
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2), observers=[observer])
    assert await scripted(app) == [201, 201, 422, 409]
    counts = {
        outcome: counter(registry, outcome)
        for outcome in ("claimed", "replayed", "mismatch", "in_flight", "succeeded", "released")
    }
    # Two claims (the first request and the held one), each settled as succeeded.
    assert counts == {
        "claimed": 2,
        "replayed": 1,
        "mismatch": 1,
        "in_flight": 1,
        "succeeded": 2,
        "released": 0,
    }
    claims = registry.get_sample_value("idem_store_seconds_count", {"step": "claim"})
    # Every request that reached the store timed its claim: not the duplicate, which waited for
    # the request this process ran without asking the store (test_duplicates_held_here.py).
    assert claims == 4
    observer.update_from_stats(await pg_store.stats())
    assert registry.get_sample_value("idem_records", {"state": "succeeded"}) == 2
    assert registry.get_sample_value("idem_oldest_unresolved_age_seconds") == 0


async def test_the_gauges_are_fed_from_the_unresolved_count_by_default(
    pg_store: Any, pool: Any
) -> None:
    """`refresh` counts pending and unknown records from their index (milliseconds, where the
    full count reads the whole table): the finished states' gauges are set only by `full=True`,
    and keep that count's value meanwhile. Lapsed leases have a gauge of their own."""
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode,"
        " retention, expires_at, response_status, lease_expires_at)"
        " SELECT 't', 'POST /x', 'k' || i, '\\x00', s, 'lease', interval '1 day',"
        " CASE WHEN s = 'succeeded' THEN now() + interval '1 day' END,"
        " CASE WHEN s = 'succeeded' THEN 201 END,"
        " CASE WHEN s = 'pending' THEN now() - interval '1 minute' END"
        " FROM generate_series(1, 6) i,"
        " LATERAL (SELECT (ARRAY['pending', 'unknown', 'succeeded'])[i % 3 + 1] AS s) x"
    )
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry=registry)
    await observer.refresh(pg_store)

    def gauge(state: str) -> float | None:
        return registry.get_sample_value("idem_records", {"state": state})

    assert (gauge("pending"), gauge("unknown"), gauge("succeeded")) == (2, 2, None)
    assert registry.get_sample_value("idem_lapsed_leases") == 2
    await observer.refresh(pg_store, full=True)
    assert (gauge("pending"), gauge("succeeded"), gauge("failed_final")) == (2, 2, 0)
    await pool.execute("DELETE FROM idem_requests WHERE state = 'pending'")
    await observer.refresh(pg_store)
    assert (gauge("pending"), gauge("succeeded")) == (0, 2)
    assert registry.get_sample_value("idem_lapsed_leases") == 0


async def test_rejections_are_counted(pg_store: Any) -> None:
    registry = CollectorRegistry()
    app = build_app(pg_store, observers=[PrometheusObserver(registry=registry)])
    async with client(app) as c:
        missing = await c.post("/accounts/a/credits", json={"amount": 1})
    assert missing.status_code == 400
    assert counter(registry, "rejected") == 1


async def test_spans_for_claim_replay_and_complete(pg_store: Any) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = OpenTelemetryObserver(tracer_provider=provider)
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2), observers=[observer])
    await scripted(app)
    names = [span.name for span in exporter.get_finished_spans()]
    assert names.count("idem.claim") == 4  # (not the duplicate's: see the claims' timings above)
    assert names.count("idem.complete") == 2
    assert names.count("idem.replay") == 1
    for span in exporter.get_finished_spans():
        assert SECRET_KEY not in str(dict(span.attributes or {}))


async def test_logs_are_structured_and_never_carry_raw_keys_or_bodies(
    pg_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = build_app(
        pg_store, default_policy=Policy(wait_seconds=0.2), observers=[LoggingObserver()]
    )
    with caplog.at_level(logging.DEBUG, logger="idem_middleware"):
        await scripted(app)
    decisions = [r for r in caplog.records if r.getMessage().startswith("idempotency ")]
    outcomes = [getattr(r, "outcome", None) for r in decisions]
    for expected in ("claimed", "replayed", "mismatch", "in_flight", "succeeded"):
        assert expected in outcomes
    for record in decisions:
        assert record.operation == OP  # type: ignore[attr-defined]
        assert record.tenant == "tenant-a"  # type: ignore[attr-defined]
        assert len(record.key_digest) == 16  # type: ignore[attr-defined]
    for record in caplog.records:
        if record.levelno >= logging.INFO:
            text = record.getMessage() + str(record.__dict__)
            assert SECRET_KEY not in text
            assert '"amount"' not in text


async def _body_once() -> dict[str, Any]:
    return {"type": "http.request", "body": b""}


def sent_to(sent: list[dict[str, Any]]) -> Any:
    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    return send


async def test_a_method_of_the_clients_invention_makes_no_new_label() -> None:
    """Found by probing: a route whose endpoint takes any method is guarded for any method but
    the safe ones, and each invented method (`X0001 /things`) was a Prometheus series of its own.
    Such methods are labelled OTHER; the records keep their own operation."""

    @idempotent()
    class Things(HTTPEndpoint):
        async def post(self, request: Request) -> Response:
            return PlainTextResponse("made", 201)

    registry = CollectorRegistry()
    app = Starlette(
        routes=[Route("/things", Things)],  # any method
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                observers=[PrometheusObserver(registry=registry)],
            ),
        ],
    )
    for method in [f"X{i:03d}" for i in range(20)] + ["POST"]:
        scope = post_scope(
            "/things",
            [(b"authorization", b"Bearer demo-a"), (b"idempotency-key", method.encode())],
        )
        scope["method"] = method
        sent: list[dict[str, Any]] = []
        await app(scope, _body_once, sent_to(sent))
        assert sent[0]["type"] == "http.response.start"
    labels = {
        sample.labels["operation"]
        for metric in registry.collect()
        for sample in metric.samples
        if "operation" in sample.labels
    }
    assert labels == {"OTHER /things", "POST /things"}


class _BrokenStream:
    """A stream that fails after its first event: its outcome was settled before its start."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await receive()
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise RuntimeError("the stream broke")


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_stream_that_fails_after_its_settlement_is_counted_as_settled_only(
    mode: Mode,
) -> None:
    """Its record says succeeded (a retry gets the replay), so no `released` is counted too."""
    registry = CollectorRegistry()
    app = Starlette(
        routes=[Route("/stream", _BrokenStream(), methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                default_policy=Policy(mode=mode),
                tenant_resolver=lambda scope: "tenant-a",
                observers=[PrometheusObserver(registry=registry)],
            )
        ],
    )
    async with client(app) as c:
        first = await c.post("/stream", json={}, headers={"idempotency-key": "k"})
        retry = await c.post("/stream", json={}, headers={"idempotency-key": "k"})
    assert first.content == b"data: 1\n\n"
    assert retry.headers["idempotency-body-omitted"] == "streaming"

    def count(outcome: str) -> float:
        labels = {"operation": "POST /stream", "outcome": outcome}
        return registry.get_sample_value("idem_requests_total", labels) or 0.0

    counted = {o: count(o) for o in ("claimed", "succeeded", "released", "replayed")}
    assert counted == {"claimed": 1, "succeeded": 1, "released": 0, "replayed": 1}


async def test_operations_named_by_a_concrete_path_make_no_series_without_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by probing: a sub-app mounted behind a wrapper the router above cannot see into
    names its operations by the path the mounts took (`POST /tenants/bob0@example.com/pay`), so
    every value a client put in the mount's parameter was a series of its own (and the path's
    values, an email here, became label values). Past `max_operations`, the rest are OTHER."""

    async def pay(request: Request) -> Response:
        return PlainTextResponse("paid", 201)

    registry = CollectorRegistry()
    inner = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                tenant_resolver=lambda scope: "tenant-a",
                observers=[PrometheusObserver(registry=registry, max_operations=3)],
            )
        ],
    )

    async def hiding(scope: Any, receive: Any, send: Any) -> None:  # no `.app` to look through
        await inner(scope, receive, send)

    outer = Starlette(routes=[Mount("/tenants/{tid}", app=hiding)])
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with client(outer) as c:
            for i in range(10):
                url = f"/tenants/bob{i}@example.com/pay"
                reply = await c.post(url, json={}, headers={"idempotency-key": f"k{i}"})
                assert reply.status_code == 201, reply.text
    labels = {
        sample.labels["operation"]
        for metric in registry.collect()
        for sample in metric.samples
        if "operation" in sample.labels
    }
    assert len(labels) == 4, labels  # three operations, then OTHER
    assert "OTHER" in labels
    claimed = registry.get_sample_value(
        "idem_requests_total", {"operation": "OTHER", "outcome": "claimed"}
    )
    assert claimed == 7  # every request is still counted
    assert len([r for r in caplog.records if "operations labelled" in r.getMessage()]) == 1


async def test_an_operation_no_template_could_name_is_labelled_other() -> None:
    """Found by probing: an operation named by a concrete path (above) was labelled whole, as
    long as the server let a path be, and written out in each of its series at every scrape: a
    thousand requests with 16 KB paths made a 64 MB exposition. One longer than
    MAX_LABEL_CHARS, or with a control character (a decoded `%0D%0A`), is OTHER, and uses up
    none of `max_operations`."""

    async def pay(request: Request) -> Response:
        return PlainTextResponse("paid", 201)

    registry = CollectorRegistry()
    observer = PrometheusObserver(registry=registry, max_operations=2)
    inner = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                tenant_resolver=lambda scope: "tenant-a",
                observers=[observer],
            )
        ],
    )

    async def hiding(scope: Any, receive: Any, send: Any) -> None:
        await inner(scope, receive, send)

    outer = Starlette(routes=[Mount("/t/{tid}", app=hiding)])
    names = [f"{i}" + "x" * MAX_LABEL_CHARS for i in range(20)] + ["a%0D%0Ab", "c%1Bd", "ok"]
    async with client(outer) as c:
        for i, name in enumerate(names):
            reply = await c.post(f"/t/{name}/pay", json={}, headers={"idempotency-key": f"k{i}"})
            assert reply.status_code == 201, reply.text
    labels = {
        sample.labels["operation"]
        for metric in registry.collect()
        for sample in metric.samples
        if "operation" in sample.labels
    }
    assert labels == {"OTHER", "POST /t/ok/pay"}
    assert len(generate_latest(registry)) < 20_000


@pytest.mark.parametrize("bound", [0, -1, 1.5, "10", True])
def test_max_operations_is_checked_when_made(bound: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_operations"):
        PrometheusObserver(registry=CollectorRegistry(), max_operations=bound)


def test_a_second_observer_in_one_registry_is_told_to_make_one_or_use_its_own() -> None:
    """Found by probing docs/observability.md as a newcomer: `PrometheusObserver()` made in an
    app factory each test calls failed at the second test with prometheus_client's bare
    "Duplicated timeseries", naming no way out. Other namespaces and registries still work."""
    registry = CollectorRegistry()
    PrometheusObserver(registry=registry)
    PrometheusObserver(registry=registry, namespace="other")
    PrometheusObserver(registry=CollectorRegistry())
    with pytest.raises(ConfigurationError, match=r"registry=CollectorRegistry\(\)") as raised:
        PrometheusObserver(registry=registry)
    assert "one per process" in str(raised.value)


@pytest.mark.parametrize("record_tenant", [False, True])
async def test_span_events_carry_the_tenant_only_when_asked(
    pg_store: Any, record_tenant: bool
) -> None:
    """Found by probing: every decision's span event carried `idem.tenant`, the authenticated
    caller's identity (an email, often), to the tracing backend. OpenTelemetry's conventions
    leave an end user's id out unless asked for; so does the observer now."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = OpenTelemetryObserver(tracer_provider=provider, record_tenant=record_tenant)
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2), observers=[observer])
    with provider.get_tracer("test").start_as_current_span("request"):
        await scripted(app)
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "request"]
    events = [dict(event.attributes or {}) for event in request.events]
    assert {event.get("idem.operation") for event in events} == {OP}
    keyed = [e for e in events if "idem.key_digest" in e]
    assert keyed  # the events of requests that reached a key name it by its digest
    everything = [dict(span.attributes or {}) for span in exporter.get_finished_spans()]
    everything += [
        dict(e.attributes or {}) for s in exporter.get_finished_spans() for e in s.events
    ]
    assert SECRET_KEY not in str(everything)
    with_tenant = [a for a in everything if "idem.tenant" in a]
    if record_tenant:
        assert with_tenant == keyed
        assert {a["idem.tenant"] for a in with_tenant} == {"tenant-a"}
    else:
        assert with_tenant == []


async def test_span_attributes_from_a_concrete_path_are_bounded() -> None:
    """Found by probing: an operation named by the concrete path a request took (a sub-app
    behind a wrapper the router cannot see into) went whole into `idem.operation` on every span
    and span event of the request, as long as the server let a path be (OpenTelemetry's SDK
    sets no length limit unless told), with the path's decoded `%0D%0A`. It is escaped and cut
    at MAX_ATTRIBUTE_CHARS, as a log message shows it."""

    async def pay(request: Request) -> Response:
        return PlainTextResponse("paid", 201)

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inner = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                tenant_resolver=lambda scope: "tenant-a",
                observers=[OpenTelemetryObserver(tracer_provider=provider)],
            )
        ],
    )

    async def hiding(scope: Any, receive: Any, send: Any) -> None:
        await inner(scope, receive, send)

    outer = Starlette(routes=[Mount("/t/{tid}", app=hiding)])
    long_name = "x" * 1000  # (the longest an operation's name may be: test_unnameable_operation.py)
    async with client(outer) as c:
        with provider.get_tracer("test").start_as_current_span("request"):
            for i, name in enumerate([long_name, "a%0D%0Ab"]):
                url = f"/t/{name}/pay"
                reply = await c.post(url, json={}, headers={"idempotency-key": f"k{i}"})
                assert reply.status_code == 201, reply.text
    spans = exporter.get_finished_spans()
    values = [dict(s.attributes or {}) for s in spans]
    values += [dict(e.attributes or {}) for s in spans for e in s.events]
    operations = {a["idem.operation"] for a in values if "idem.operation" in a}
    assert len(operations) == 2, operations
    assert all(len(op) <= MAX_ATTRIBUTE_CHARS + 40 for op in operations), operations
    assert all(op.isprintable() for op in operations), operations
    assert any("(1012 characters)" in op for op in operations), operations
