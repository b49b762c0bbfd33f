"""What the middleware checks once, before it serves (at lifespan startup, or at the first request
when the server sends no lifespan): it lists every operation it will guard, warns about policies
that can never apply, and refuses a configuration that cannot work."""

from __future__ import annotations

import asyncio
import difflib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute
from starlette.types import Scope

from .body_limits import declared_limit, limit_warning, mounted_limit, tighter
from .endpoints import SAFE_METHODS as SAFE_METHODS
from .endpoints import WRAPPER_ATTRIBUTE, endpoint_policy
from .errors import NOT_OPEN, ConfigurationError
from .library_routes import (
    shared_names,
    tell_library_routes,
)
from .middleware_order import (
    check_authentication,
    check_outer_middleware,
    endings,
    middleware_inside,
)
from .mounted import (
    guarded_below,
    ignored_settings,
    methods_of,
    nested_policy_errors,
    stacked_policy_errors,
)
from .observe import shown
from .policy import Mode, Policy, operation_name, pinned_method_error
from .routing import (
    Found,
    Hidden,
    listed_routes,
    router_of,
    walk,
)
from .startup_dependencies import dependency_errors, websocket_errors
from .startup_status import status_route_errors
from .tenant import ROUTE_RESOLVER_ATTRIBUTE, ROUTE_TENANTS_ATTRIBUTE, Tenants

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware

logger = logging.getLogger("idem_middleware")

ON_ANOTHER_LOOP = (
    "the app runs on an event loop other than asyncio's (trio, say: `hypercorn -k trio`); the "
    "middleware runs on asyncio only: serve the app with an asyncio worker"
)
#: The middleware's `methods` when none are given.
DEFAULT_METHODS = frozenset({"POST", "PATCH"})


def check_app(mw: IdempotencyMiddleware, app: Any, scope: Scope | None = None) -> None:
    """Log every guarded operation (info, one line each) and every policy that can never apply
    (warning); raise ConfigurationError for a route that cannot work as configured. `scope`:
    the first request's, when the check runs then (a mounted sub-app gets no lifespan)."""
    try:
        asyncio.get_running_loop()  # (its waits, timers and tasks, and asyncpg's, are asyncio's)
    except RuntimeError:
        raise ConfigurationError(ON_ANOTHER_LOOP) from None
    routes = listed_routes(app) if app is not None else None
    if routes is None:
        routes = listed_routes(mw.app)
    if routes is None:
        logger.warning("idempotency: no router found behind the middleware; nothing is guarded")
        return
    if not mw.enabled:
        logger.warning("idempotency: the middleware is disabled (kill switch); nothing is guarded")
    elif scope is not None and not getattr(mw.store, "is_open", True):  # (no lifespan ran)
        logger.error(
            "idempotency: %s (until then guarded requests answer 503). No lifespan startup "
            "reached the middleware: the server sends none (daphne never does, nor "
            "`uvicorn --lifespan off` or `granian --interface asginl`), or the app is mounted in "
            "another",
            NOT_OPEN,
        )
    errors: list[str] = []
    reachable: set[str] = set()
    served = app if app is not None else mw.app
    router = mounted_limit(served, own=False)  # (FastAPI's app's)
    own_router = router_of(served)
    items = _named_above(routes, scope, own_router)
    endpoints = {id(item.endpoint) for item in items if isinstance(item, Found)}
    for item in items:
        if isinstance(item, Hidden):
            _report_hidden(mw, item)
            continue
        wrapper = getattr(item.endpoint, WRAPPER_ATTRIBUTE, None)
        if wrapper is not None and id(wrapper) not in endpoints:
            errors.append(_decorated_above(item))
        _check_route_tenant(mw, item)
        explicit = endpoint_policy(item.endpoint)
        methods = methods_of(item)
        unsafe = [m for m in methods if m not in SAFE_METHODS]
        if explicit is not None and explicit.guard and not unsafe:
            logger.warning(
                "idempotency: the policy on %s can never apply: %s requests are never guarded",
                shown(item.template),
                "/".join(methods),
            )
        per_method: dict[str, Policy | None] = {}
        for method in methods:
            name = operation_name(method, item.template)
            policy = None if method in SAFE_METHODS else mw.policy_for(method, item)
            per_method[method] = policy
            if method in SAFE_METHODS:
                continue
            reachable.add(name)
            if policy is not None:
                if pinned := pinned_method_error(method, item.template, policy):
                    errors.append(pinned)
                if warning := _limit_warning(name, policy, item, router):
                    logger.warning("idempotency: %s", warning)
            if name in mw.policies and (
                error := _overridden(name, mw.policies[name], item, method)
            ):
                errors.append(error)
        # (switched off, no claim is made, on any store: the dependency's error names the switch)
        errors.extend(dependency_errors(item, per_method, mw.store if mw.enabled else None))
    found = list(guarded_routes(routes, mw.policy_for, items))
    guarded = [(operation_name(m, item.template, policy), policy) for item, m, policy in found]
    for name, policy in guarded:
        # (shown: under a wrapper the router cannot see into, the first request's concrete path
        # names the operation, and its decoded `%0D%0A` would forge a log line)
        logger.info("idempotency: guarding %s (%s)", shown(name), describe(policy))
    if reachable and not guarded:  # (`methods=()` and no policy yet, say: a silent no-op)
        listed = ", ".join(sorted(mw.methods)) or "none"
        none = f"{len(reachable)} unsafe operations (its methods: {listed})"
        logger.warning("idempotency: the middleware guards none of the app's %s", none)
    errors.extend(shared_names(guarded))
    # The status and token routes' view of the app, and its problem_base.
    errors.extend(tell_library_routes(items, guarded, mw.problem_base, mw.store))
    for name in sorted(set(mw.policies) - reachable):  # a typo, or a prefix left out
        close = _meant(name, reachable)
        hint = f" (did you mean {close!r}?)" if close else ""
        errors.append(f"policies[{name!r}] matches no route, so it can never apply{hint}")
    if guarded and app is not None:
        inside = list(middleware_inside(routes, [item for item, _, _ in found]))
        policies = [p for _, p in guarded]
        if (auth_error := check_authentication(mw, app, policies, inside)) is not None:
            errors.append(auth_error)
        check_outer_middleware(mw, app, inside)
    if not guarded_below(served):  # (else the outer one answers)
        above = status_above(scope, own_router, routes)
        errors.extend(status_route_errors(mw, routes, found, items, above))
    errors.extend(_unserved_methods(mw, items))
    errors += nested_policy_errors(mw.policy_for, routes) + stacked_policy_errors(mw, app, found)
    for warning in ignored_settings(mw, app, routes):
        logger.warning("idempotency: %s", warning)
    errors.extend(websocket_errors(routes))
    if errors:
        raise ConfigurationError("; ".join(errors))


def _overridden(name: str, entry: Policy, item: Found, method: str) -> str | None:
    """The error when the endpoint's own policy, which wins, leaves `name` unguarded while its
    `policies` entry guards it (the route ran unguarded, a warning its only trace); a warning
    for any other entry the endpoint's policy overrides."""
    own = endpoint_policy(item.endpoint, method)  # (an HTTPEndpoint's method's too)
    if own is None:
        return None
    if entry.guard and not own.guard:
        return (
            f"policies[{name!r}] guards it, but its endpoint is exempt (@not_idempotent, or "
            "@idempotent(guard=False)), which wins: it would run unguarded. Drop the entry, or "
            "the exemption"
        )
    logger.warning("idempotency: policies[%r] never applies: the endpoint's own policy does", name)
    return None


def _meant(name: str, reachable: set[str]) -> str | None:
    """The operation a `policies` key most likely meant: the shortest of the method's that end
    with its path (a mount's or a router's prefix left out), else the closest spelling."""
    method, _, path = name.partition(" ")
    ends = [op for op in reachable if op.startswith(f"{method} /") and op.endswith(path)]
    if len(path) > 1 and ends:
        return min(ends, key=lambda op: (len(op), op))
    close = difflib.get_close_matches(name, sorted(reachable), n=1, cutoff=0.5)
    return close[0] if close else None


def guarded_routes(
    routes: Sequence[BaseRoute],
    policy_for: Callable[[str, Found], Policy | None],
    items: Sequence[Found | Hidden] | None = None,
) -> Iterator[tuple[Found, str, Policy]]:
    """Every operation guarded among `routes` (in the router's order, methods sorted) with its
    policy, as `policy_for` (the middleware's `policy_for`) resolves it. What startup lists, and
    what the CLI and OpenAPI read: one resolution, so they cannot disagree. `items`: the routes
    as `walk` lists them, named otherwise (see `_named_above`)."""
    for item in walk(routes) if items is None else items:
        if isinstance(item, Found):
            for method in methods_of(item):
                policy = None if method in SAFE_METHODS else policy_for(method, item)
                if policy is not None:
                    yield item, method, policy


def _seen_as(above: str, mine: str) -> bool:
    """Whether a route listed from the router above as `above` is the app's own `mine`: the
    path at its end, and the host of a `Host` of the app's own (`api.example/pay`, listed from
    above under a mount as `api.example/v1/pay`)."""
    host, path = _split_host(mine)
    above_host, above_path = _split_host(above)
    return above_path.endswith(path) and (not host or host == above_host)


def _split_host(template: str) -> tuple[str, str]:
    slash = template.find("/")
    return ("", template) if slash <= 0 else (template[:slash], template[slash:])


def _routes_above(scope: Scope | None, own_router: Any) -> Sequence[BaseRoute] | None:
    """The routes of the router above an app checked at its first request (Starlette's first
    leaves itself in the scope); None when there is none, or it is the app's own."""
    router = (scope or {}).get("router")
    return None if router is None or router is own_router else listed_routes(router)


def _seen_above(above: Sequence[BaseRoute], own: list[Found]) -> Iterator[tuple[Found, Found]]:
    """Each route the router above lists that is one of the app's own, with it."""
    # (A scan of `own` per route was quadratic: 8,000 routes of one endpoint took 40 seconds.)
    by_path: dict[tuple[int, str | None], list[tuple[int, Found]]] = {}
    for index, mine in enumerate(own):
        path = _split_host(mine.template)[1]
        key = (id(mine.endpoint), path if path.startswith("/") else None)
        by_path.setdefault(key, []).append((index, mine))
    for item in walk(above):
        if isinstance(item, Found):
            endpoint = id(item.endpoint)
            # (`_seen_as`: its path ends with theirs, which starts with a slash but for a few)
            ending = [
                pair
                for path in (*endings(_split_host(item.template)[1]), None)
                for pair in by_path.get((endpoint, path), ())
            ]
            for _, mine in sorted(ending, key=lambda pair: pair[0]):
                if _seen_as(item.template, mine.template):
                    yield item, mine


def status_above(
    scope: Scope | None, own_router: Any, routes: Sequence[BaseRoute]
) -> Sequence[BaseRoute] | None:
    """The routes of the router above an app checked at its first request, if that router
    lists the app's routes nowhere but at their own paths (a router's default app): the 202's
    Location (the request's root path + status_path) is then resolved there from the top.
    None if the app is mounted under a prefix anywhere: each mount's Location is its own."""
    above = _routes_above(scope, own_router)
    if above is None:
        return None
    own = [item for item in walk(routes) if isinstance(item, Found)]
    for item, mine in _seen_above(above, own):
        if _split_host(item.template)[1] != _split_host(mine.template)[1]:
            return None
    return above


def _named_above(
    routes: Sequence[BaseRoute], scope: Scope | None, own_router: Any = None
) -> list[Found | Hidden]:
    """The app's routes named as its requests are (`routing.routed_above`): a sub-app with its
    own middleware, mounted at `/api` by an app without one, sees its own `/pay`, and its
    requests are `POST /api/pay`; its check runs at its first request, whose scope holds the
    router above. Named as that router lists them (each mount of the sub-app), or, where it
    cannot see into the sub-app, with the path the mounts took."""
    items = list(walk(routes))
    above = _routes_above(scope, own_router)
    if above is None:
        return items
    own = [item for item in items if isinstance(item, Found)]
    # (each listed once, however many of the app's own routes it is seen as)
    named: list[Found | Hidden] = list({id(i): i for i, _ in _seen_above(above, own)}.values())
    if named or not own:
        return named + [item for item in items if isinstance(item, Hidden)]
    assert scope is not None
    root_path = scope.get("root_path", "")
    app_root_path = scope.get("app_root_path", root_path)
    mounted = root_path[len(app_root_path) :] if root_path.startswith(app_root_path) else ""
    return list(walk(routes, mounted))


def _unserved_methods(mw: IdempotencyMiddleware, items: Sequence[Found | Hidden]) -> list[str]:
    """`methods` naming one that no route serves guards nothing, and was accepted without a word
    (`methods={"PUT", "POSTT"}`). A misspelling of a method routes serve and `methods` leaves
    out is an error (those routes go unguarded); any other is a warning (routes may come later;
    the default's POST and PATCH are never reported). Not checked when a route takes any method,
    or hides its routes from the router."""
    if any(isinstance(item, Hidden) or item.methods is None for item in items):
        return []
    served = {method for item in items if isinstance(item, Found) for method in item.methods or ()}
    left_out = sorted(served - mw.methods - SAFE_METHODS)
    errors = []
    for method in sorted(mw.methods - served):
        close = difflib.get_close_matches(method, left_out, n=1, cutoff=0.75)
        if close:
            errors.append(
                f"methods names {method!r}, which no route serves, so it guards nothing, while "
                f"the {close[0]} routes go unguarded (did you mean {close[0]!r}?)"
            )
        elif method not in DEFAULT_METHODS:
            logger.warning(
                "idempotency: methods names %r, which no route serves: it guards nothing", method
            )
    return errors


def _decorated_above(item: Found) -> str:
    name = getattr(item.endpoint, "__qualname__", repr(item.endpoint))
    return (
        f"{name} ({item.template}) has @idempotent above its route decorator, which registered "
        "the function without it: its policy never applies. Put @idempotent below the route "
        "decorator (@app.post(...), then @idempotent(...), then the def)"
    )


def describe(policy: Policy) -> str:
    """A policy in a few words, for the startup log (no secrets: a reconciler is named only)."""
    parts = [policy.mode.value, "key required" if policy.key_required else "key optional"]
    if policy.allow_anonymous:
        parts.append("anonymous allowed")
    if policy.require_token:
        parts.append("tokens only")
    parts.append(f"wait {policy.wait_seconds:g}s")
    if policy.mode is Mode.LEASE:
        parts.append(f"lease {policy.lease_seconds:g}s, {policy.on_lease_expiry.value} on expiry")
    return ", ".join(parts)


def _report_hidden(mw: IdempotencyMiddleware, item: Hidden) -> None:
    if not item.unresolvable:
        logger.info(
            "idempotency: %s: its routes cannot be seen; its requests are not guarded",
            shown(item.where),
        )
        return
    policy = endpoint_policy(item.endpoint)
    if policy is not None and not policy.guard:
        return
    if policy is not None or mw.methods:
        logger.error(
            "idempotency: %s has no path the middleware can name; its %s requests are refused "
            "(500) rather than run unguarded. Give the route a `path`, or mark its endpoint "
            "@not_idempotent",
            shown(item.where),
            "non-safe" if policy is not None else "/".join(sorted(mw.methods)),
        )


def _check_route_tenant(mw: IdempotencyMiddleware, item: Found) -> None:
    """The status and token routes must name the caller's tenant as the middleware does: given
    another resolver, every token is refused as not the caller's and every status is a 404."""
    resolver = getattr(item.endpoint, ROUTE_RESOLVER_ATTRIBUTE, None)
    if resolver is not None and resolver is not mw.tenant_resolver:
        logger.warning(
            "idempotency: %s resolves tenants with %r, the middleware with %r: unless both name "
            "the same tenant, its answers are about nobody's requests; pass the middleware's "
            "tenant_resolver to it",
            shown(item.template),
            resolver,
            mw.tenant_resolver,
        )
    # Their 401s need the app's challenge too (RFC 9110), which the middleware was given.
    tenants = getattr(item.endpoint, ROUTE_TENANTS_ATTRIBUTE, None)
    challenge = mw.tenants.challenge
    if isinstance(tenants, Tenants) and challenge is not None:
        if tenants.challenge is None:
            tenants.challenge = challenge
        elif tenants.challenge != challenge:
            logger.warning(
                "idempotency: %s answers its 401s with WWW-Authenticate %r, the middleware with "
                "%r; pass the middleware's www_authenticate to it",
                shown(item.template),
                tenants.challenge.decode("latin-1"),
                challenge.decode("latin-1"),
            )


def _limit_warning(name: str, policy: Policy, item: Found, router: int | None) -> str | None:
    """A guarded route whose own `max_body_size` a guarded request cannot reach (body_limits;
    the limits of enclosing mounts are not seen here)."""
    declared = declared_limit(item.route)
    return limit_warning(shown(name), policy, declared, tighter(declared, router))
