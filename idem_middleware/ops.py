"""Operator functions: find, resolve and reconcile the records nobody retries.

The CLI is a thin adapter over these; they work on any Store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from starlette.routing import BaseRoute, Mount, Route, Router

from .errors import ResolveError as ResolveError
from .fence import Verdict, run_reconciler
from .middleware import IdempotencyMiddleware
from .policy import Policy, endpoint_policy, operation_name
from .reconcile import Reconciler
from .store.base import RecordKey, Settlement, State, Store, StoredResponse


class Resolution(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED_FINAL = "failed_final"
    #: It did not happen: the client's next retry (same key, same body) runs it again.
    RETRY = "retry"


async def resolve(
    store: Store,
    key: RecordKey,
    to: Resolution,
    *,
    note: str,
    response: StoredResponse | None = None,
) -> None:
    """Move an `unknown` record by hand, with an audit note kept on the record."""
    if not note.strip():
        raise ValueError("an audit note is required")
    record = await store.get(key)
    if record is None or record.state is not State.UNKNOWN:
        state = "absent" if record is None else record.state.value
        raise ResolveError(f"only unknown records can be resolved; this one is {state}")
    if to is Resolution.RETRY:
        moved = await store.allow_retry(key, record.generation, note)
    else:
        stored = response or StoredResponse(200 if to is Resolution.SUCCEEDED else 400, (), b"")
        moved = await store.settle(
            key, record.generation, State.UNKNOWN, Settlement(State(to.value), stored, note=note)
        )
    if not moved:
        raise ResolveError("the record changed while it was being resolved")


@dataclass
class ReconcileReport:
    examined: int = 0
    expired_leases: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    #: Operations that had unknown records but no reconciler.
    unreconcilable: dict[str, int] = field(default_factory=dict)


async def reconcile_unknown(
    store: Store,
    reconcilers: Mapping[str, Reconciler],
    *,
    tenant: str | None = None,
    operation: str | None = None,
    limit: int = 100,
    seconds: float = 10.0,
) -> ReconcileReport:
    """Settle unknown records (and pending ones whose lease lapsed) by asking their reconcilers.

    `Happened` settles the record; `NotHappened` lets the client's next retry run it again.
    """
    report = ReconcileReport()
    stale = await store.list_records(
        states=[State.PENDING], tenant=tenant, operation=operation, limit=limit, stale_only=True
    )
    for summary in stale:
        if summary.lease_expired and await store.expire_lease(summary.key, summary.generation):
            report.expired_leases += 1
    unknown = await store.list_records(
        states=[State.UNKNOWN], tenant=tenant, operation=operation, limit=limit
    )
    for summary in unknown:
        report.examined += 1
        reconciler = reconcilers.get(summary.key.operation)
        if reconciler is None:
            op = summary.key.operation
            report.unreconcilable[op] = report.unreconcilable.get(op, 0) + 1
            continue
        result = await run_reconciler(
            store, summary.key, summary.generation, reconciler, seconds=seconds, epoch=summary.epoch
        )
        verdict = result.verdict
        if verdict is Verdict.NOT_HAPPENED:
            await store.allow_retry(summary.key, summary.generation, "reconciled: not happened")
        report.verdicts[verdict.value] = report.verdicts.get(verdict.value, 0) + 1
    return report


@dataclass(frozen=True, slots=True)
class GuardedOperation:
    method: str
    #: The route template, as the operation name uses it (`/items/{item_id:int}`).
    template: str
    #: The same path as OpenAPI writes it (`/items/{item_id}`).
    path_format: str
    policy: Policy

    @property
    def name(self) -> str:
        return operation_name(self.method, self.template)


def guarded_operations(app: Any) -> list[GuardedOperation]:
    """Every guarded operation of a Starlette/FastAPI app and its policy, as the middleware
    would resolve them (endpoint decorator, then the `policies` mapping, then the default)."""
    middleware = _find_middleware(app)
    found: list[GuardedOperation] = []
    for template, path_format, route in _walk(app.router.routes, ""):
        for method in sorted(getattr(route, "methods", None) or ()):
            name = operation_name(method, template)
            policy = endpoint_policy(route.endpoint)
            if policy is None and middleware is not None:
                policy = middleware.get("policies", {}).get(name)
                if policy is None and method in set(middleware.get("methods", ("POST", "PATCH"))):
                    policy = middleware.get("default_policy") or Policy()
            if policy is not None and policy.guard:
                found.append(GuardedOperation(method, template, path_format, policy))
    return found


def collect_policies(app: Any) -> dict[str, Policy]:
    return {op.name: op.policy for op in guarded_operations(app)}


def collect_reconcilers(app: Any) -> dict[str, Reconciler]:
    """The reconciler of every guarded operation that has one (for `idem-middleware reconcile`)."""
    return {
        name: policy.reconciler
        for name, policy in collect_policies(app).items()
        if policy.reconciler is not None
    }


def _find_middleware(app: Any) -> dict[str, Any] | None:
    for entry in getattr(app, "user_middleware", ()):
        if entry.cls is IdempotencyMiddleware:
            return dict(entry.kwargs)
    return None


def _walk(routes: Iterable[BaseRoute], prefix: str) -> Iterable[tuple[str, str, Route]]:
    for route in routes:
        if isinstance(route, Mount):
            if isinstance(route.app, Router):  # a mounted application is not guarded
                yield from _walk(route.app.routes, prefix + route.path)
        elif isinstance(route, Route):
            yield prefix + route.path, prefix + route.path_format, route
