"""Two things the scripted sequence of test_observability shows that nothing pinned: a
duplicate's wait for its original is timed in `idem_wait_seconds`, by operation (not as a store
step in `idem_store_seconds`, where an operator's latency alert on the store would fire for a
slow handler); and the request's span carries `idem.outcome`, its last decision, as an
attribute a tracing backend can filter on (events alone cannot be)."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from idem_middleware import Policy
from idem_middleware.otel import OpenTelemetryObserver
from idem_middleware.prometheus import PrometheusObserver
from tests.apps import build_app
from tests.integration.test_observability import OP, scripted


async def test_a_duplicates_wait_is_timed_by_operation_not_as_a_store_step(pg_store: Any) -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry=registry)
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2), observers=[observer])
    assert await scripted(app) == [201, 201, 422, 409]
    waits = registry.get_sample_value("idem_wait_seconds_count", {"operation": OP})
    assert waits is not None
    assert waits >= 1
    assert registry.get_sample_value("idem_store_seconds_count", {"step": "wait"}) is None


async def test_the_request_span_carries_its_outcome(pg_store: Any) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = OpenTelemetryObserver(tracer_provider=provider)
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2), observers=[observer])
    with provider.get_tracer("test").start_as_current_span("request"):
        await scripted(app)
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "request"]
    last = request.events[-1].name.removeprefix("idem.")
    assert (request.attributes or {}).get("idem.outcome") == last
