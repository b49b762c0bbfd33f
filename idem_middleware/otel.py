"""OpenTelemetry spans (extra `otel`: opentelemetry-api only; bring your own SDK).

    app.add_middleware(IdempotencyMiddleware, store=store, observers=[OpenTelemetryObserver()])

Spans `idem.claim`, `idem.wait`, `idem.replay` and `idem.complete` nest under the request's span;
each decision is an event on the current span. Raw keys never become attributes, and the tenant
(the authenticated caller's identity, often personal data) only with `record_tenant=True`: spans
leave the process for a tracing backend, and OpenTelemetry's own conventions leave an end user's
id out unless asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import trace
except ModuleNotFoundError as exc:  # installed without the extra
    from .errors import missing_extra

    raise missing_extra(__name__, "otel", exc) from exc

from .observe import Event


def _attributes(attributes: Mapping[str, Any], tenant: bool = False) -> dict[str, Any]:
    return {
        f"idem.{k}": v
        for k, v in attributes.items()
        if isinstance(v, (str, int, float)) and (tenant or k != "tenant")
    }


class OpenTelemetryObserver:
    def __init__(
        self, tracer_provider: trace.TracerProvider | None = None, *, record_tenant: bool = False
    ) -> None:
        self.tracer = trace.get_tracer("idem_middleware", tracer_provider=tracer_provider)
        self.record_tenant = record_tenant

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event(f"idem.{event.value}", _attributes(attributes, self.record_tenant))
            span.set_attribute("idem.outcome", event.value)

    @contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        with self.tracer.start_as_current_span(
            f"idem.{name}", attributes=_attributes(attributes, self.record_tenant)
        ):
            yield
