"""The startup check of the status resource: a policy with `accept_while_in_flight` answers a
duplicate in flight with 202 + the Location of the status resource, which some route of the app
must serve, on the host the client used, or the client polls a 404 (and may take it for
"unknown request" and send it again under a new key)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute, Host, Match, Mount

from .library_routes import ROUTE_OPERATIONS_ATTRIBUTE, GuardedOperations
from .observe import shown
from .policy import Policy, operation_name
from .routing import Found, Hidden, listed_routes, match_route, mounted_app

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware

logger = logging.getLogger("idem_middleware")

#: How deep `_serves` follows mounts (a default app may lead back up: then "cannot be seen").
_MAX_DEPTH = 32
#: A host pattern's parameters (`{tenant}.example.com`, `{n:int}.example.com`), each asked as
#: one concrete label its converter takes, unlike any literal host's (`x.example.com`).
_HOST_PARAMETER = re.compile(r"\{[^}:]*(?::(\w+))?\}")
_SAMPLES = {"int": "0", "float": "0", "uuid": "00000000-0000-0000-0000-000000000000"}


def status_route_errors(
    mw: IdempotencyMiddleware,
    routes: Sequence[BaseRoute],
    found: Sequence[tuple[Found, str, Policy]],
    items: Sequence[Found | Hidden],
    above: Sequence[BaseRoute] | None = None,
) -> list[str]:
    """Per host the accepting operations are served on (a `Host`'s, or none), whether the status
    resource is what a GET of the status path reaches there. A route of the app's own served
    there first shadows a status resource the app has: the client gets that route's answer (an
    error); alone there, it may be the app's own status resource (a warning)."""
    by_host: dict[str, list[str]] = {}
    for item, method, policy in found:
        if policy.accept_while_in_flight:
            name = operation_name(method, item.template, policy)
            by_host.setdefault(_host_of(item.template), []).append(name)
    errors: list[str] = []
    for host, accepting in by_host.items():
        if above is not None and _status_served(above, mw.status_path, host):
            continue  # (the router above serves the Location: see startup.status_above)
        error = _status_error(mw, routes, host, ", ".join(accepting), items)
        if error is not None:
            errors.append(error)
    return errors


def _status_served(routes: Sequence[BaseRoute], path: str, host: str) -> bool:
    headers = [(b"host", host.encode("latin-1", "replace"))] if host else []
    served = _serves(routes, {"type": "http", "method": "GET", "path": path, "headers": headers})
    return served is True or _is_status(served)


def _host_of(template: str) -> str:
    """The host an operation's template is served on ("" for none: `/pay`, not `api.example/pay`),
    a pattern's parameters each made one label."""
    if template.startswith("/"):
        return ""
    pattern = template.partition("/")[0]
    return _HOST_PARAMETER.sub(lambda found: _SAMPLES.get(found[1], "idem-probe"), pattern)


def _status_error(
    mw: IdempotencyMiddleware,
    routes: Sequence[BaseRoute],
    host: str,
    which: str,
    items: Sequence[Found | Hidden],
) -> str | None:
    path = mw.status_path
    headers = [(b"host", host.encode("latin-1", "replace"))] if host else []
    served = _serves(routes, {"type": "http", "method": "GET", "path": path, "headers": headers})
    where = f" on {host}" if host else ""
    if served is not None and served is not False:
        if served is True or _is_status(served):
            return None
        name = getattr(served, "__qualname__", None) or type(served).__name__
        shadowed = f"GET {path}{where} goes to the app's own {name!r}, not to the status resource"
        if not any(_is_status(getattr(item, "endpoint", None)) for item in items):
            logger.warning(
                "idempotency: accept_while_in_flight on %s answers a duplicate in flight with "
                "202 + Location %s?operation=...&key=...: %s; it must answer as "
                "idem_middleware.status.status_route(store) does",
                which,
                path,
                shown(shadowed),
            )
            return None
        return (
            f"accept_while_in_flight=True on {which} answers a duplicate in flight with 202 + "
            f"Location {path}?..., but {shadowed}, which the app also has: a client following "
            f"the Location would get that route's answer. Put status_route(store) before it, or "
            f"serve one of them at another path (and set the middleware's status_path to the "
            f"status resource's)"
        )
    if served is None:
        logger.warning(
            "idempotency: accept_while_in_flight on %s answers a duplicate in flight with 202 + "
            "Location %s, a path that goes to a mounted application whose routes cannot be "
            "seen%s: make sure it serves idem_middleware.status.status_route(store)",
            which,
            path,
            shown(where),
        )
        return None
    if not host and (hosts := _hosts_serving(routes, path)):
        logger.warning(  # (the operation answers on any host, the status resource on these)
            "idempotency: accept_while_in_flight on %s answers a duplicate in flight with 202 + "
            "Location %s, which only %s serve%s: a client on another host gets a 404",
            which,
            path,
            shown(", ".join(hosts)),
            "s" if len(hosts) == 1 else "",
        )
        return None
    on = f"; on {host}, as the operation" if host else ""
    return (
        f"accept_while_in_flight=True on {which} answers a duplicate in flight with 202 + "
        f"Location {path}?..., but no route of the app serves GET {path}{where}: add "
        f"idem_middleware.status.status_route(store) to the app's routes (its path must be the "
        f"middleware's status_path, {path!r}{on}), or set status_path to where it is served"
    )


def _hosts_serving(routes: Sequence[BaseRoute], path: str) -> list[str]:
    """The hosts of the app's `Host` routes on which a GET of `path` reaches the status
    resource."""
    hosts = []
    for route in routes:
        if isinstance(route, Host):
            host = _host_of(route.host + "/")
            scope = {"type": "http", "method": "GET", "path": path}
            served = _serves(
                routes, {**scope, "headers": [(b"host", host.encode("latin-1", "replace"))]}
            )
            if served is True or _is_status(served):
                hosts.append(route.host)
    return hosts


def _is_status(endpoint: object) -> bool:
    operations = getattr(endpoint, ROUTE_OPERATIONS_ATTRIBUTE, None)
    return isinstance(operations, GuardedOperations) and operations.kind == "status"


def _serves(routes: Sequence[BaseRoute], scope: dict[str, Any], depth: int = 0) -> object:
    """The endpoint a GET of `scope["path"]` on the scope's host reaches, as the router would
    find it (True when it has none to name); False when none; None when it may reach a mounted
    application whose routes cannot be seen. The router hands the request to the first `Host`
    or `Mount` that matches, found below it or not."""
    for route in routes:
        if isinstance(route, Host | Mount):
            match, child = route.matches(scope)
            if match is not Match.FULL:
                continue
            inner = listed_routes(mounted_app(route)) if depth < _MAX_DEPTH else None
            return None if inner is None else _serves(inner, {**scope, **child}, depth + 1)
        reached = match_route([route], scope)
        if reached is not None:
            return getattr(reached, "endpoint", None) or True
    return False
