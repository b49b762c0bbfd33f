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
    from opentelemetry.trace import Status, StatusCode
except ModuleNotFoundError as exc:  # installed without the extra
    from .errors import missing_extra

    raise missing_extra(__name__, "otel", exc) from exc

from .errors import ClaimBusy, ClaimTimeout, ConfigurationError, IdempotencyError
from .observe import Event, shown

#: What leaves a step as the protocol's own course, not as a failure: a key held by another
#: request (the duplicate waits, then replays). Recorded as errors, they made every ordinary
#: duplicate an error span in a tracing backend, its error rate and its alerts.
_NOT_FAILURES = (ClaimBusy, ClaimTimeout)

#: The longest text attribute set whole. A route template is far shorter; an operation named by
#: the concrete path a request took (a sub-app behind a wrapper the router cannot see through)
#: is as long as the server lets a path be, and went on every span and event of the request
#: (OpenTelemetry's SDK sets no length limit unless configured).
MAX_ATTRIBUTE_CHARS = 256


def _attributes(attributes: Mapping[str, Any], tenant: bool = False) -> dict[str, Any]:
    """The `idem.*` attributes; a text one escaped when it holds a control character (a decoded
    `%0D%0A`) and cut at MAX_ATTRIBUTE_CHARS, as a log message shows it (`observe.shown`)."""
    return {
        f"idem.{k}": shown(v, MAX_ATTRIBUTE_CHARS) if isinstance(v, str) else v
        for k, v in attributes.items()
        if isinstance(v, (str, int, float)) and (tenant or k != "tenant")
    }


class OpenTelemetryObserver:
    def __init__(
        self, tracer_provider: trace.TracerProvider | None = None, *, record_tenant: bool = False
    ) -> None:
        if not isinstance(record_tenant, bool):  # ("false", a str, recorded the tenant)
            raise ConfigurationError(f"record_tenant must be True or False, not {record_tenant!r}")
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
            f"idem.{name}",
            attributes=_attributes(attributes, self.record_tenant),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield
            except _NOT_FAILURES:
                raise
            except BaseException as exc:  # as OpenTelemetry's default would record it
                if span.is_recording():
                    if isinstance(exc, IdempotencyError):
                        span.record_exception(exc)
                        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                    else:  # (a driver's error can quote the row, the key and body in it)
                        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
                        span.add_event("exception", {"exception.type": kind})
                        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise
