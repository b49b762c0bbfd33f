"""Observers and stores that cannot work are refused at construction, and the Prometheus
observer's bounds hold against what a client or a neighbouring exporter brings: each of these
was found by probing, accepted, and then failed quietly (metrics lost, every request a 500)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.applications import Starlette

from idem_middleware import IdempotencyMiddleware, MemoryStore, PostgresStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.observe import Event, LoggingObserver, Observers
from idem_middleware.prometheus import OVERFLOW, PrometheusObserver


def operations(registry: CollectorRegistry) -> set[str]:
    return {
        sample.labels["operation"]
        for metric in registry.collect()
        for sample in metric.samples
        if "operation" in sample.labels
    }


def test_invented_methods_use_up_one_operation_not_one_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A route taking any method: each invented method (`X001 /things`) was kept under its raw
    name, labelled `OTHER /things`, so ten of them used up `max_operations=10`, warned that the
    limit was reached, and the app's real operations were counted as OTHER after."""
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry=registry, max_operations=3)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        for i in range(50):
            observer.event(Event.CLAIMED, {"operation": f"X{i:03d} /things"})
        observer.event(Event.CLAIMED, {"operation": "POST /pay"})
    assert operations(registry) == {"OTHER /things", "POST /pay"}
    assert not [r for r in caplog.records if "operations labelled" in r.getMessage()]
    spray = {"operation": "OTHER /things", "outcome": "claimed"}
    assert registry.get_sample_value("idem_requests_total", spray) == 50
    observer.event(Event.CLAIMED, {"operation": "PUT /pay"})  # the third, then the limit
    observer.event(Event.CLAIMED, {"operation": "DELETE /pay"})
    assert operations(registry) == {"OTHER /things", "POST /pay", "PUT /pay", OVERFLOW}


@pytest.mark.parametrize("taken", ["idem_requests", "idem_records", "idem_lapsed_leases"])
def test_a_metric_name_another_exporter_holds_is_named_and_nothing_is_registered(
    taken: str,
) -> None:
    """Registered one by one, a clash on `idem_records` left the metrics before it in the
    registry and was blamed on a second PrometheusObserver."""
    registry = CollectorRegistry()
    Gauge(taken, "another exporter's", registry=registry)
    with pytest.raises(ConfigurationError, match=taken) as raised:
        PrometheusObserver(registry=registry)
    assert "already registered" in str(raised.value)
    assert "PrometheusObserver with namespace" not in str(raised.value)
    assert {metric.name for metric in registry.collect()} == {taken}
    PrometheusObserver(registry=registry, namespace="other")  # the way out it names


def test_a_second_observer_is_still_told_so_and_leaves_the_first_alone() -> None:
    registry = CollectorRegistry()
    first = PrometheusObserver(registry=registry)
    before = {metric.name for metric in registry.collect()}
    with pytest.raises(ConfigurationError, match="one per process"):
        PrometheusObserver(registry=registry)
    assert {metric.name for metric in registry.collect()} == before
    first.event(Event.CLAIMED, {"operation": "POST /pay"})
    claimed = {"operation": "POST /pay", "outcome": "claimed"}
    assert registry.get_sample_value("idem_requests_total", claimed) == 1


def test_a_failed_registration_unregisters_what_it_registered() -> None:
    """All or nothing however registration fails: a clash after the first metric, by another
    exporter's Counter whose samples share a name, still leaves nothing of the observer."""
    registry = CollectorRegistry()
    Counter("idem_store_seconds", "another exporter's", registry=registry)
    with pytest.raises(ConfigurationError, match="idem_store_seconds"):
        PrometheusObserver(registry=registry)
    assert {metric.name for metric in registry.collect()} == {"idem_store_seconds"}


class AsyncEvent:
    async def event(self, event: Event, attributes: Mapping[str, Any]) -> None: ...

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        yield


class AsyncContextTimed:
    def event(self, event: Event, attributes: Mapping[str, Any]) -> None: ...

    @contextlib.asynccontextmanager
    async def timed(self, name: str, attributes: Mapping[str, Any]) -> AsyncIterator[None]:
        yield


class AsyncTimed:
    def event(self, event: Event, attributes: Mapping[str, Any]) -> None: ...

    async def timed(self, name: str, attributes: Mapping[str, Any]) -> None: ...


def make(**options: Any) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(Starlette(), **{"store": MemoryStore(), **options})


@pytest.mark.parametrize(
    ("observer", "said"),
    [
        (LoggingObserver, "LoggingObserver is a class"),
        (PrometheusObserver, "PrometheusObserver is a class"),
        (AsyncEvent(), r"AsyncEvent\.event is async"),
        (AsyncContextTimed(), r"AsyncContextTimed\.timed is async"),
        (AsyncTimed(), r"AsyncTimed\.timed is async"),
    ],
    ids=["logging-class", "prometheus-class", "async-event", "asynccontextmanager", "async-timed"],
)
def test_an_observer_that_cannot_work_is_refused_at_construction(observer: Any, said: str) -> None:
    """Each passed the check for callable `event` and `timed`: a class failed every call (logged
    as "the observer type failed"), an `async def event` was never awaited (nothing recorded),
    an async `timed` failed at every step."""
    with pytest.raises(ConfigurationError, match=said):
        make(observers=[observer])
    with pytest.raises(ConfigurationError, match=said):
        make(observers=observer)


def test_a_working_observer_is_still_accepted() -> None:
    make(observers=[LoggingObserver(), PrometheusObserver(registry=CollectorRegistry())])


@pytest.mark.parametrize(("level", "number"), [("INFO", 20), ("DEBUG", 10), (25, 25), (0, 0)])
def test_a_logging_level_is_taken_as_logging_takes_it(
    level: int | str, number: int, caplog: pytest.LogCaptureFixture
) -> None:
    """`level="INFO"` was kept as the string, and every event failed in `isEnabledFor`."""
    observer = LoggingObserver(level=level)
    assert observer.level == number
    with caplog.at_level(logging.DEBUG, logger="idem_middleware"):
        observer.event(Event.CLAIMED, {"operation": "POST /pay"})
    assert [r.levelno for r in caplog.records] == ([number] if number else [])


@pytest.mark.parametrize("level", ["info", "VERBOSE", 25.5, None, True, b"INFO"])
def test_a_logging_level_that_is_no_level_is_refused(level: Any) -> None:
    with pytest.raises(ConfigurationError, match="level"):
        LoggingObserver(level=level)


def test_a_failing_observer_given_as_a_class_is_named_by_the_class(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Observers built directly (the middleware refuses a class): the log named it "type"."""

    class Collector:
        def event(self, event: Event, attributes: Mapping[str, Any]) -> None: ...

    observers = Observers([Collector])  # type: ignore[list-item]
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        observers.event(Event.CLAIMED, {"operation": "POST /pay"})
    (record,) = caplog.records
    assert "the observer Collector failed" in record.getMessage()


@pytest.mark.parametrize("store", [MemoryStore, PostgresStore], ids=lambda s: s.__name__)
def test_a_store_class_is_refused_at_construction(store: type) -> None:
    """`store=MemoryStore` was accepted and failed every request with a TypeError; the
    PostgresStore class failed at startup with a TypeError from `bound_checkouts`."""
    with pytest.raises(
        ConfigurationError, match=f"store instance .* not the class {store.__name__}"
    ):
        make(store=store)
