"""Hooks for metrics, tracing and logs: one small protocol, any number of backends.

The middleware calls an Observer at each decision. Prometheus (`idem_middleware.prometheus`) and
OpenTelemetry (`idem_middleware.otel`) ship as optional backends; StatsD or anything else is a
class with these two methods. With no observer configured the middleware pays nothing but a
`None` check.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from enum import StrEnum
from typing import Any, Literal, Protocol

from .context import Outcome
from .errors import ConfigurationError, ProblemKind

logger = logging.getLogger("idem_middleware")


class Event(StrEnum):
    """What happened to one guarded request (the `outcome` label of the request counter)."""

    CLAIMED = "claimed"  # this request owns the key; the handler runs
    REPLAYED = "replayed"  # a stored response was replayed
    MISMATCH = "mismatch"  # the key was used for a different request: 422
    IN_FLIGHT = "in_flight"  # the original is still running: 409 (or 202)
    UNKNOWN = "unknown"  # the original's outcome is unknown: 409
    # the handler did nothing (4xx, 5xx in transactional mode), or its transactional outcome
    # could not be recorded (a refused settlement rolled it back): nothing stored, the key free
    RELEASED = "released"
    SUCCEEDED = "succeeded"  # the outcome was stored as succeeded
    FAILED_FINAL = "failed_final"  # the outcome was stored as a final failure
    UNRESOLVED = "unresolved"  # lease mode: the handler's outcome was recorded as unknown
    REJECTED = "rejected"  # refused before any claim: bad or missing key, body, no tenant
    ERROR = "error"  # the store could not be reached (or mark a claim's end: see below)
    # lease mode: this execution lost its claim (its lease lapsed, the record taken over or
    # marked unknown); its outcome was not recorded, another generation's stands: 409
    STALE = "stale"
    # ended before any decision: the server cancelled it (its shutdown: 503), or its client
    # left while it waited for another request's key
    CANCELLED = "cancelled"


#: The event a settled outcome is counted as.
SETTLED_EVENTS = {
    Outcome.SUCCEEDED: Event.SUCCEEDED,
    Outcome.FAILED_FINAL: Event.FAILED_FINAL,
    Outcome.RELEASE: Event.RELEASED,
    Outcome.UNKNOWN: Event.UNRESOLVED,
}

#: The event a problem the middleware answers is counted as; any other kind is `rejected`.
PROBLEM_EVENTS = {
    ProblemKind.KEY_REUSED: Event.MISMATCH,
    ProblemKind.IN_FLIGHT: Event.IN_FLIGHT,
    ProblemKind.OUTCOME_UNKNOWN: Event.UNKNOWN,
    ProblemKind.STORE_UNAVAILABLE: Event.ERROR,
}


def store_error_event(kind: ProblemKind, counted: Event | None) -> Event | None:
    """What a store's error answered to the client is counted as, after `counted` (the last
    event counted of the request; None: none). Before a claim, as its kind says (`error`; an
    encoding that cannot store the key: `rejected`). After one, never `rejected` (a claimed
    request was not refused), and its end counted once: nothing more if the mode counted it
    (`released`: a refused settlement rolled the claim's transaction back; lease mode's
    `unresolved`: the record marked unknown), `error` if not (the store could not mark it)."""
    if counted is None:
        return PROBLEM_EVENTS.get(kind, Event.REJECTED)
    return Event.ERROR if counted is Event.CLAIMED else None


class Observer(Protocol):
    # (Positional-only: the middleware passes both so, and an observer names them as it likes.)
    def event(self, event: Event, attributes: Mapping[str, Any], /) -> None:
        """One decision about a request (`operation` and, where known, `generation`)."""

    def timed(self, name: str, attributes: Mapping[str, Any], /) -> AbstractContextManager[None]:
        """Around a step: `claim`, `wait`, `replay`, `complete`, `store.<query>`."""


class LoggingObserver:
    """Structured stdlib logs: one INFO line per decision, with `extra` fields.

    Raw keys and bodies never appear; `key_digest` identifies a key across log lines.
    """

    def __init__(self, level: int | str = logging.INFO) -> None:
        self.level = _logging_level(level)

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        if logger.isEnabledFor(self.level):
            fields = {"outcome": event.value, **attributes}
            operation = fields.get("operation")
            if isinstance(operation, str):  # (a concrete path's: escaped and cut, see `shown`)
                fields["operation"] = shown(operation)
            logger.log(self.level, "idempotency %s", event.value, extra=fields)

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        yield


def _logging_level(level: object) -> int:
    """`level` as the stdlib's logging takes it, a number or a level's name ('INFO'), made a
    number; anything else refused now (it failed every event, each failure logged instead)."""
    if type(level) is int:
        return level
    number = logging.getLevelNamesMapping().get(level) if isinstance(level, str) else None
    if number is None:
        raise ConfigurationError(
            "LoggingObserver: level must be a logging level, a number (logging.INFO) or a "
            f"level's name ('INFO'), not {level!r}"
        )
    return number


class Observers:
    """Fans each call out to several observers, and keeps their failures to themselves.

    An observer is a bystander: one that raises (a collector, a tracer, a logging handler that
    fails) must not change the request's answer, and above all must not come between a claim and
    its settlement (a lease-mode claim left pending, an outcome recorded but answered 500). Its
    exception is logged (the first with its traceback at WARNING, the rest at DEBUG) and the
    request goes on; the other observers are still called. Only `Exception` is caught: a
    cancellation goes through, and a timer never swallows the step's own exception.
    """

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)
        self._failed: set[int] = set()

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        for observer in self.observers:
            try:
                answer: object = observer.event(event, attributes)  # type: ignore[func-returns-value]
                if answer is not None:
                    _never_awaited(answer)
            except Exception:
                self.failed(observer, f"event {event.value}")

    def timed(self, name: str, attributes: Mapping[str, Any]) -> AbstractContextManager[None]:
        return _Timers(self, name, attributes)

    def failed(self, observer: Observer, where: str) -> None:
        first = id(observer) not in self._failed
        self._failed.add(id(observer))
        # (not even this line may fail the request: the failing observer may be the logs' own)
        with contextlib.suppress(Exception):
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "idempotency: the observer %s failed (%s); the request goes on%s",
                _observer_name(observer),
                where,
                "" if first else " (logged at WARNING the first time only)",
                exc_info=True,
            )


def _never_awaited(answer: object) -> None:
    """What an `event` returned, when it returned something: an awaitable (an object with an
    `async def __call__` given as `event`, a function handing back a coroutine) is never
    awaited, its event lost with no observer named: closed, and the observer's failure."""
    if inspect.isawaitable(answer):
        close = getattr(answer, "close", None)
        if callable(close):
            close()
        raise TypeError(
            f"event returned {type(answer).__name__}, an awaitable the middleware does not "
            "await: it must do its work (or hand it to a task of its own) and return None"
        )


def _observer_name(observer: object) -> str:
    """The observer's class name (the class's own, for a class given where an instance goes:
    its type's is `type`)."""
    return observer.__name__ if isinstance(observer, type) else type(observer).__name__


class _Timers:
    """Each observer's timer around one step; one that fails to start or to stop is left out."""

    __slots__ = ("attributes", "entered", "fan", "name")

    def __init__(self, fan: Observers, name: str, attributes: Mapping[str, Any]) -> None:
        self.fan = fan
        self.name = name
        self.attributes = attributes
        self.entered: list[tuple[Observer, AbstractContextManager[None]]] = []

    def __enter__(self) -> None:
        for observer in self.fan.observers:
            try:
                timer = observer.timed(self.name, self.attributes)
                timer.__enter__()
            except Exception:
                self.fan.failed(observer, f"starting {self.name}")
            else:
                self.entered.append((observer, timer))

    def __exit__(self, *exc_info: Any) -> Literal[False]:
        while self.entered:
            observer, timer = self.entered.pop()
            try:
                timer.__exit__(*exc_info)
            except Exception as exc:
                if exc is not exc_info[1]:  # (one that re-raises the step's own: not its failure)
                    self.fan.failed(observer, f"ending {self.name}")
        return False  # the step's exception, if any, goes on: an observer never swallows it


def combine(observers: Observer | Sequence[Observer] | None) -> Observer | None:
    if observers is None:
        return None
    if not isinstance(observers, Sequence):
        observers = (observers,)
    return Observers(observers) if observers else None


#: The longest text of a client's that a log message shows whole.
SHOWN_CHARS = 200


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` as a log message may show it: as it is when printable, escaped (`repr`) when it
    holds a line break, an escape sequence or another control character, and cut at `limit`.
    For what may come from a client: an operation named by the concrete path a request took (a
    sub-app behind a wrapper the router cannot see through), whose `%0D%0A` the server decoded
    into a line break that would forge a log line of its own."""
    text = text if text.isprintable() else repr(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


#: What `timed` returns when nothing observes: a context manager that does nothing.
UNTIMED = contextlib.nullcontext()
