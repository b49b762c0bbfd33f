"""OpenTelemetry spans (extra `otel`: opentelemetry-api only; bring your own SDK).

    app.add_middleware(IdempotencyMiddleware, store=store, observers=[OpenTelemetryObserver()])

Spans `idem.claim`, `idem.wait`, `idem.replay` and `idem.complete` nest under the request's span;
each decision is an event on the current span. Raw keys never become attributes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace

from .observe import Event


def _attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {f"idem.{k}": v for k, v in attributes.items() if isinstance(v, (str, int, float))}


class OpenTelemetryObserver:
    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer("idem_middleware", tracer_provider=tracer_provider)

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event(f"idem.{event.value}", _attributes(attributes))
            span.set_attribute("idem.outcome", event.value)

    @contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        with self.tracer.start_as_current_span(f"idem.{name}", attributes=_attributes(attributes)):
            yield
