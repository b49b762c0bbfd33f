"""A span that ends in an error not of the library's records its type alone: a driver's error
can quote the row it refused (`Failing row contains (tenant, operation, key, ..., body)`), and
a tracing backend is no place for a raw key or a body. The library's own errors, whose words
it chose, are recorded whole."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from idem_middleware.errors import StoreError
from idem_middleware.otel import OpenTelemetryObserver

RAW = "Failing row contains (tenant-a, POST /pay, raw-key-4242, card 4242424242424242)"


def _spans(error: BaseException) -> list[Any]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = OpenTelemetryObserver(tracer_provider=provider)
    with pytest.raises(type(error)), observer.timed("claim", {}):
        raise error
    return list(exporter.get_finished_spans())


def test_a_drivers_error_is_recorded_by_its_type_alone() -> None:
    (span,) = _spans(asyncpg.exceptions.CheckViolationError(RAW))
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "CheckViolationError"
    assert [dict(e.attributes or {}) for e in span.events] == [
        {"exception.type": "asyncpg.exceptions.CheckViolationError"}
    ]
    assert "raw-key-4242" not in repr(span.to_json())


def test_the_librarys_own_error_is_recorded_whole() -> None:
    (span,) = _spans(StoreError("the database did not answer in 2 s"))
    assert span.status.description == "StoreError: the database did not answer in 2 s"
    (event,) = span.events
    assert event.attributes is not None
    assert event.attributes["exception.message"] == "the database did not answer in 2 s"
