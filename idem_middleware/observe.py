"""Hooks for metrics, tracing and logs: one small protocol, any number of backends.

The middleware calls an Observer at each decision. Prometheus (`idem_middleware.prometheus`) and
OpenTelemetry (`idem_middleware.otel`) ship as optional backends; StatsD or anything else is a
class with these two methods. With no observer configured the middleware pays nothing but a
`None` check.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from enum import StrEnum
from typing import Any, Protocol

from .context import Outcome

logger = logging.getLogger("idem_middleware")


class Event(StrEnum):
    """What happened to one guarded request (the `outcome` label of the request counter)."""

    CLAIMED = "claimed"  # this request owns the key; the handler runs
    REPLAYED = "replayed"  # a stored response was replayed
    MISMATCH = "mismatch"  # the key was used for a different request: 422
    IN_FLIGHT = "in_flight"  # the original is still running: 409 (or 202)
    UNKNOWN = "unknown"  # the original's outcome is unknown: 409
    RELEASED = "released"  # the handler did nothing (4xx, 5xx in transactional mode): key free
    SUCCEEDED = "succeeded"  # the outcome was stored as succeeded
    FAILED_FINAL = "failed_final"  # the outcome was stored as a final failure
    UNRESOLVED = "unresolved"  # lease mode: the handler's outcome was recorded as unknown
    REJECTED = "rejected"  # refused before any claim: bad or missing key, body, no tenant
    ERROR = "error"  # the store could not be reached


#: The event a settled outcome is counted as.
SETTLED_EVENTS = {
    Outcome.SUCCEEDED: Event.SUCCEEDED,
    Outcome.FAILED_FINAL: Event.FAILED_FINAL,
    Outcome.RELEASE: Event.RELEASED,
    Outcome.UNKNOWN: Event.UNRESOLVED,
}


class Observer(Protocol):
    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        """One decision about a request (`operation` and, where known, `generation`)."""

    def timed(self, name: str, attributes: Mapping[str, Any]) -> AbstractContextManager[None]:
        """Around a step: `claim`, `wait`, `replay`, `complete`, `store.<query>`."""


class LoggingObserver:
    """Structured stdlib logs: one INFO line per decision, with `extra` fields.

    Raw keys and bodies never appear; `key_digest` identifies a key across log lines.
    """

    def __init__(self, level: int = logging.INFO) -> None:
        self.level = level

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        if logger.isEnabledFor(self.level):
            logger.log(
                self.level,
                "idempotency %s",
                event.value,
                extra={"outcome": event.value, **attributes},
            )

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        yield


class Observers:
    """Fans each call out to several observers."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        for observer in self.observers:
            observer.event(event, attributes)

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for observer in self.observers:
                stack.enter_context(observer.timed(name, attributes))
            yield


def combine(observers: Observer | Sequence[Observer] | None) -> Observer | None:
    if observers is None:
        return None
    if isinstance(observers, Sequence):
        if not observers:
            return None
        return observers[0] if len(observers) == 1 else Observers(observers)
    return observers


#: What `timed` returns when nothing observes: a context manager that does nothing.
UNTIMED = contextlib.nullcontext()
