"""The startup check of a FastAPI route's claim dependencies (`IdempotencyConnection`,
`ClaimSession`, `Idempotency`): each needs its route guarded, and in the way it works."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from starlette.routing import BaseRoute, Host, Mount, WebSocketRoute

from .endpoints import endpoint_policy
from .policy import Mode, Policy, operation_name
from .routing import _MAX_WRAPPERS, Found, _included, listed_routes, mounted_app


def _dependency_calls(dependant: Any, overrides: Any = None) -> Iterator[Callable[..., Any]]:
    """`overrides`: the app's `dependency_overrides`, if given: one overridden there is not run,
    nor what it depends on."""
    for dependency in getattr(dependant, "dependencies", ()):
        if overrides and dependency.call in overrides:
            continue
        if dependency.call is not None:
            yield dependency.call
        yield from _dependency_calls(dependency, overrides)


def _claim_dependency(calls: set[Callable[..., Any]]) -> tuple[str, bool] | None:
    """The claim dependency a route declares, if any: its name, and whether it needs
    transactional mode. Each is recognised by identity, from its module if it was imported (a
    route cannot declare one whose module was not): nothing optional is imported here."""
    fastapi_wiring = sys.modules.get("idem_middleware.fastapi")
    if fastapi_wiring is not None and fastapi_wiring.transaction_connection in calls:
        return "IdempotencyConnection", True
    sqla = sys.modules.get("idem_middleware.sqla")
    if sqla is not None and any(_is_claim_session(sqla, call) for call in calls):
        return "ClaimSession", False
    if fastapi_wiring is not None and fastapi_wiring.idempotency_context in calls:
        return "Idempotency", False
    return None


def _is_claim_session(sqla: Any, call: Callable[..., Any]) -> bool:
    """`claim_session` (what `ClaimSession` depends on), or a `ClaimSessions(...).dependency`."""
    if call is getattr(sqla, "claim_session", None):
        return True
    sessions = getattr(sqla, "ClaimSessions", None)
    owner = getattr(call, "__self__", None)
    return (
        sessions is not None
        and isinstance(owner, sessions)
        and getattr(call, "__name__", None) == "dependency"
    )


NO_CONNECTION = (
    "the store is a MemoryStore, whose claims have no database connection: use PostgresStore (a "
    "unit test without a database can override the dependency in app.dependency_overrides, or "
    "use the pytest plugin's idem_store, on PostgreSQL)"
)


def dependency_errors(
    item: Found, per_method: dict[str, Policy | None], store: object
) -> list[str]:
    """A FastAPI route that takes the claim's context, connection or SQLAlchemy session must be
    guarded for every method it accepts, with the key required (and, for the connection, in
    transactional mode), and the connection or session needs a store whose claims have one:
    otherwise it fails on every such request. `store`: the middleware's (None: switched off)."""
    dependant = getattr(item.route, "dependant", None)
    if dependant is None:
        return []
    wanted = _claim_dependency(set(_dependency_calls(dependant)))
    if wanted is None:
        return []
    what, transactional_only = wanted
    errors = _event_stream_errors(item, dependant, per_method)
    connected = _connection_dependency(item, dependant, store)
    for method, policy in per_method.items():
        named = what
        if policy is None:
            problem = "is not guarded"
        elif not policy.key_required:
            problem = "lets a request without a key through (key_required=False)"
        elif transactional_only and policy.mode is not Mode.TRANSACTIONAL:
            problem = "is in lease mode (use Idempotency and idem.fenced_connection())"
        elif connected is not None:
            named, problem = connected, NO_CONNECTION
        else:
            continue
        errors.append(f"{operation_name(method, item.template)} declares {named} but {problem}")
    return errors


def _connection_dependency(item: Found, dependant: Any, store: object) -> str | None:
    """The connection or claim session a route takes when the store's claims have no database
    connection (MemoryStore's: its transaction's `connection` and its `fenced_connection()`
    are None, in either mode), unless the app overrides it (a test's own). MemoryStore is
    looked up only if its module was imported: no store can be one otherwise."""
    memory = sys.modules.get("idem_middleware.store.memory")
    if memory is None or not isinstance(store, memory.MemoryStore):
        return None
    provider = getattr(item.route, "dependency_overrides_provider", None)
    overrides = getattr(provider, "dependency_overrides", None)
    run = _claim_dependency(set(_dependency_calls(dependant, overrides)))
    return None if run is None or run[0] == "Idempotency" else run[0]


def _event_stream_errors(item: Found, dependant: Any, methods: dict[str, Any]) -> list[str]:
    """FastAPI runs an `EventSourceResponse` generator's body in a task of its own, beside the
    response, whose start settles the claim: the connection or session it takes races that."""
    direct = {dependency.call for dependency in dependant.dependencies}
    what = _claim_dependency(direct) if getattr(item.route, "is_sse_stream", False) else None
    if what is None or what[0] == "Idempotency":
        return []
    return [
        f"{operation_name(method, item.template)} declares {what[0]} in a generator of "
        "server-sent events, whose body FastAPI runs beside the response, once the claim is "
        "being settled: write in a dependency of the route (it runs first), or return a stream"
        for method in methods
    ]


def websocket_errors(routes: Sequence[BaseRoute]) -> list[str]:
    """A websocket route is never guarded (no request to claim, replay or refuse): a policy on
    its endpoint, or a claim dependency it declares, failed every connection with an error that
    said no IdempotencyMiddleware handled it."""
    return [
        f"the websocket route {path} {what}, but websocket routes are never guarded (a "
        "connection is no request to claim)"
        for path, what in _websocket_claims(routes)
    ]


def _websocket_claims(
    routes: Sequence[BaseRoute], prefix: str = "", depth: int = 0
) -> Iterator[tuple[str, str]]:
    for route in routes:
        if isinstance(route, WebSocketRoute):
            policy = endpoint_policy(route.endpoint)
            dependant = getattr(route, "dependant", None)
            calls = set(_dependency_calls(dependant)) if dependant is not None else set()
            if policy is not None and policy.guard:
                yield prefix + route.path, "has a policy (@idempotent)"
            elif (wanted := _claim_dependency(calls)) is not None:
                yield prefix + route.path, f"declares {wanted[0]}"
        elif (contexts := _included(route)) is not None:
            inner = [c.starlette_route for c in contexts if c.starlette_route is not None]
            yield from _websocket_claims(inner, prefix, depth)
        elif isinstance(route, Mount | Host) and depth < _MAX_WRAPPERS:
            where = prefix + route.path if isinstance(route, Mount) else route.host + prefix
            yield from _websocket_claims(listed_routes(mounted_app(route)) or (), where, depth + 1)
