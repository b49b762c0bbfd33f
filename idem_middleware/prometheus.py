"""Prometheus metrics (extra `metrics`: prometheus-client).

    observer = PrometheusObserver()
    app.add_middleware(IdempotencyMiddleware, store=store, observers=[observer])
    ...
    await observer.refresh(store)   # the gauges, every minute or so: pending and unknown
    # records from their index (milliseconds); `full=True` also counts the finished ones, a
    # read of the whole table (docs/operating.md, Maintenance at scale)

Labels are the operation and the outcome only: tenants and keys never become label values. An
operation's method is the client's to choose (a route whose endpoint takes any method is guarded
for any method but the safe ones): one outside HTTP's own is labelled `OTHER`, so a client cannot
make series without end. Nor through the path: an operation is named by its route template, but a
sub-app mounted behind a wrapper the router above cannot see through is named by the concrete
path the mounts took (`POST /tenants/7/pay`), one per value; past `max_operations` operations, the
rest are counted under `OTHER`, and so is an operation longer than `MAX_LABEL_CHARS` or holding a
control character (a path's decoded `%0D%0A`): no template is, and a label is written out in each
of its operation's series at every scrape.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.metrics import MetricWrapperBase
except ModuleNotFoundError as exc:  # installed without the extra
    from .errors import missing_extra

    raise missing_extra(__name__, "metrics", exc) from exc

from .errors import ConfigurationError
from .middleware_arguments import HTTP_METHODS
from .observe import Event
from .store.base import StoreStats

#: The label of every operation past `max_operations`, and of one no template could name.
OVERFLOW = "OTHER"
#: The longest operation labelled as itself: a route template is far shorter; a concrete path
#: (below) may be as long as the server lets a path be, and the label is written out in every
#: series of that operation at every scrape.
MAX_LABEL_CHARS = 256


def operation_label(operation: str) -> str:
    """`operation` as a label value: its route template (one of the app's), and its method, or
    OTHER for a method of the client's invention; OTHER for an operation no template names (one
    too long, or with a control character: a concrete path's decoded `%0D%0A`)."""
    if len(operation) > MAX_LABEL_CHARS or not operation.isprintable():
        return OVERFLOW
    method, space, template = operation.partition(" ")
    return operation if method in HTTP_METHODS else f"OTHER{space}{template}"  # (any other)


logger = logging.getLogger("idem_middleware")


class CountingStore(Protocol):
    """A store that counts its records (both stores do)."""

    async def stats(self, *, unresolved_only: bool = False) -> StoreStats: ...


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class PrometheusObserver:
    def __init__(
        self,
        registry: CollectorRegistry = REGISTRY,
        namespace: str = "idem",
        *,
        max_operations: int = 1000,
    ) -> None:
        if type(max_operations) is not int or max_operations < 1:
            raise ConfigurationError(f"max_operations must be an int >= 1, not {max_operations!r}")
        self.max_operations = max_operations
        #: The operation labels given: at most `max_operations` of them. Kept by label, not by
        #: operation, so that a client's invented methods (`X001 /things`, `X002 /things`, ...,
        #: each `OTHER /things`) use up one place, not one each.
        self._labels: set[str] = set()
        self._make(namespace)
        self._register(
            registry,
            namespace,
            (
                self.requests,
                self.wait_seconds,
                self.store_seconds,
                self.records,
                self.oldest_unresolved,
                self.lapsed_leases,
            ),
        )

    def _make(self, namespace: str) -> None:
        """The metrics, in no registry yet (`_register` adds them all or none)."""
        self.requests = Counter(
            "requests",
            "Guarded requests by operation and outcome",
            ["operation", "outcome"],
            namespace=namespace,
            registry=None,
        )
        self.wait_seconds = Histogram(
            "wait_seconds",
            "Time a duplicate spent waiting for the original request",
            ["operation"],
            namespace=namespace,
            registry=None,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        )
        self.store_seconds = Histogram(
            "store_seconds",
            "Latency of idempotency store steps (claim, complete, replay)",
            ["step"],
            namespace=namespace,
            registry=None,
            buckets=_LATENCY_BUCKETS,
        )
        self.records = Gauge(
            "records",
            "Records by state, from the last store stats",
            ["state"],
            namespace=namespace,
            registry=None,
        )
        self.oldest_unresolved = Gauge(
            "oldest_unresolved_age_seconds",
            "Age of the oldest pending or unknown record (alert on this)",
            namespace=namespace,
            registry=None,
        )
        self.lapsed_leases = Gauge(
            "lapsed_leases",
            "Pending records whose lease lapsed: their executor died or stalled",
            namespace=namespace,
            registry=None,
        )

    @staticmethod
    def _register(
        registry: CollectorRegistry, namespace: str, metrics: tuple[MetricWrapperBase, ...]
    ) -> None:
        """All or none: a name another exporter holds left the metrics registered before it in
        the registry (and was blamed on a second PrometheusObserver)."""
        registered: list[MetricWrapperBase] = []
        taken: list[str] = []
        try:
            for metric in metrics:
                try:
                    registry.register(metric)
                except ValueError as exc:
                    if "Duplicated timeseries" not in str(exc):
                        raise
                    taken.append(next(iter(metric.describe())).name)
                else:
                    registered.append(metric)
            if len(taken) == len(metrics):
                raise ConfigurationError(
                    f"a PrometheusObserver with namespace {namespace!r} is already registered "
                    "in this registry (prometheus_client's default one unless registry= is "
                    "given): make one per process, at import, and give it to every app; an app "
                    "built for each test gives its own PrometheusObserver(registry="
                    "CollectorRegistry())"
                )
            if taken:
                names = ", ".join(taken)
                raise ConfigurationError(
                    f"{names}: a metric of this name is already registered in this registry "
                    "(another exporter's): give PrometheusObserver a namespace= of its own, or "
                    "a registry= of its own"
                )
        except BaseException:
            for metric in registered:
                registry.unregister(metric)
            raise

    def _label(self, operation: str) -> str:
        if operation in self._labels:
            return operation  # (the common case: a label is its own label)
        label = operation_label(operation)
        if label == OVERFLOW or label in self._labels:
            return label  # (OVERFLOW not kept: no template names it, and it may be 64 KB long)
        if len(self._labels) >= self.max_operations:
            return OVERFLOW
        self._labels.add(label)
        if len(self._labels) == self.max_operations:
            logger.warning(
                "idempotency metrics: %d operations labelled; any further one is counted as "
                "operation=%s (a sub-app mounted behind a wrapper the router cannot see through "
                "names its operations by their concrete path)",
                self.max_operations,
                OVERFLOW,
            )
        return label

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        self.requests.labels(self._label(attributes.get("operation", "")), event.value).inc()

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if name == "wait":
                operation = self._label(attributes.get("operation", ""))
                self.wait_seconds.labels(operation).observe(elapsed)
            else:
                self.store_seconds.labels(name).observe(elapsed)

    async def refresh(self, store: CountingStore, *, full: bool = False) -> None:
        """Feed the gauges from the store's counts: by default of pending and unknown records
        only, read from their partial index (milliseconds, whatever the table's size). `full`
        counts the finished ones too: a read of the whole table (0.45 s on 2 million records),
        for one process every few minutes, not every worker at every scrape."""
        self.update_from_stats(await store.stats(unresolved_only=not full))

    def update_from_stats(self, stats: StoreStats) -> None:
        """Feed the gauges from `store.stats()` (the same numbers the CLI's `stats` prints).
        A state the stats did not count (succeeded and failed_final, after
        `stats(unresolved_only=True)`) keeps the value of the last count that had it."""
        for state, count in stats.counts.items():
            self.records.labels(state).set(count)
        oldest = stats.oldest_unresolved_age_seconds
        self.oldest_unresolved.set(0.0 if oldest is None else oldest)
        self.lapsed_leases.set(stats.lapsed_leases)
