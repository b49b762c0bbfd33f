"""IdempotencyMiddlewares below an app's router: in a `Mount`'s own `middleware=[...]`, or in a
mounted app's stack. Under an app with a middleware of its own they guard nothing (the outer one
guards their requests, and they pass them on); under an app without one they guard their routes,
named from the top router as their requests are (`routing.routed_above`). What the operator's
commands and the OpenAPI document read, and what the outer middleware's startup check compares
with its own policies."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from starlette.endpoints import HTTPEndpoint
from starlette.routing import BaseRoute, Host, Mount

from .library_routes import same_records
from .routing import Found, _no_converters, listed_routes, mounted_app, walk

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware
    from .policy import Policy

#: How many wrapping middlewares are looked through for the IdempotencyMiddleware.
_MAX_WRAPPERS = 32
#: How many mounts deep the routes are looked through.
_MAX_DEPTH = 32
#: The methods a route that accepts any method (an ASGI app as a Route's endpoint) is listed for.
_UNSAFE_METHODS = ("DELETE", "PATCH", "POST", "PUT")


def find_middleware(app: Any) -> IdempotencyMiddleware | None:
    """The IdempotencyMiddleware that serves `app`: the one running (in its middleware stack, or
    wrapping it), else one built from its `add_middleware` arguments, as Starlette will build it."""
    from .middleware import IdempotencyMiddleware  # (the middleware's startup imports this)

    for start in (getattr(app, "middleware_stack", None), app):
        for layer in _layers(start):
            if isinstance(layer, IdempotencyMiddleware):
                return layer
    for entry in getattr(app, "user_middleware", ()):
        cls = entry.cls
        if isinstance(cls, type) and issubclass(cls, IdempotencyMiddleware):
            return cls(app.router, *entry.args, **entry.kwargs)
    return None


def _layers(layer: Any) -> Iterator[Any]:
    """`layer`, the app it wraps (`.app`), the app that one wraps, ... (at most _MAX_WRAPPERS)."""
    for _ in range(_MAX_WRAPPERS):
        if layer is None:
            return
        yield layer
        layer = getattr(layer, "app", None)


def mounted_middlewares(
    routes: Sequence[BaseRoute],
    prefix: str = "",
    shown: str = "",
    depth: int = 0,
    apps: list[Any] | None = None,
) -> Iterator[tuple[IdempotencyMiddleware, list[Found]]]:
    """Each IdempotencyMiddleware of a Mount or Host below `routes` (the first on each way down),
    with the routes it would guard, named from the top as `routing.walk` names them; the apps
    it serves go to `apps`."""
    if depth >= _MAX_DEPTH:
        return
    for route in routes:
        if not isinstance(route, Mount | Host):
            continue
        below = mounted_app(route)
        inner = listed_routes(below)
        if inner is None:
            continue
        found = find_middleware(route.app) or find_middleware(below)
        if found is not None:
            items = walk([route], prefix, shown)
            if apps is not None:
                apps.append(below)
            yield found, [item for item in items if isinstance(item, Found)]
        elif isinstance(route, Mount):
            path = prefix + route.path
            yield from mounted_middlewares(
                inner, path, shown + _no_converters(route.path), depth + 1, apps
            )
        else:
            yield from mounted_middlewares(inner, route.host + prefix, shown, depth + 1, apps)


#: The apps below an IdempotencyMiddleware that have one of their own (`ignored_settings` finds
#: them at the outer one's startup check): the outer one guards their requests and answers their
#: duplicates with its own Location, so the inner one's status path is never asked.
_GUARDED_BELOW: weakref.WeakSet[Any] = weakref.WeakSet()


def guarded_below(app: Any) -> bool:
    """Whether an outer IdempotencyMiddleware found `app`'s own below it (see `_GUARDED_BELOW`)."""
    try:
        return app in _GUARDED_BELOW
    except TypeError:  # (an app that cannot be weakly referenced was never recorded)
        return False


def methods_of(item: Found) -> list[str]:
    """The methods a route is listed and checked for: its own; an `HTTPEndpoint` class's, those
    it defines; else every unsafe one (it takes any)."""
    if item.methods is not None:
        return sorted(item.methods)
    endpoint = item.endpoint
    if isinstance(endpoint, type) and issubclass(endpoint, HTTPEndpoint):
        # (The others are its 405: a class-level policy pinning `POST /payments` on a class
        # that serves POST alone named PUT, PATCH and DELETE too, and failed the startup.)
        return [m for m in _UNSAFE_METHODS if callable(getattr(endpoint, m.lower(), None))]
    return list(_UNSAFE_METHODS)


def nested_policy_errors(
    policy_for: Callable[[str, Found], Policy | None], routes: Sequence[BaseRoute]
) -> list[str]:
    """A middleware inside another guards nothing (the outer one guards its requests): where
    its policy for an operation differs from the outer one's (`policy_for`), its configuration
    would be silently ignored."""
    errors = []
    for inner, items in mounted_middlewares(routes):
        for item in items:
            for method in methods_of(item):  # (a safe method: no policy either way)
                theirs, ours = inner.policy_for(method, item), policy_for(method, item)
                if theirs != ours:
                    errors.append(
                        f"{method} {item.template} is guarded by this IdempotencyMiddleware "
                        f"({_described(ours)}), and the one mounted inside it for it would "
                        f"guard it otherwise ({_described(theirs)}): the inner one never "
                        "guards its requests, and its policies never apply. Give both the "
                        "same policies, or install the middleware once"
                    )
    return errors


def stacked_policy_errors(
    mw: IdempotencyMiddleware, app: Any, found: Sequence[tuple[Found, str, Policy]]
) -> list[str]:
    """Another IdempotencyMiddleware in the app's own stack (install() beside a
    Middleware(IdempotencyMiddleware, ...) of the app's, say): of a route both guard, the outer
    one guards the requests and the inner passes them on, so where their policies differ one
    configuration is silently ignored. (`found`: what `mw` guards, as startup lists it.)"""
    from .middleware import IdempotencyMiddleware  # (the middleware's startup imports this)

    stack = _layers(getattr(app, "middleware_stack", None))
    others = [
        layer for layer in stack if isinstance(layer, IdempotencyMiddleware) and layer is not mw
    ]
    return [
        f"{method} {item.template} is guarded by two IdempotencyMiddlewares in the app's "
        f"middleware list, otherwise ({_described(ours)}; {_described(theirs)}): only the outer "
        "one guards its requests, and the other's policies never apply. Give both the same "
        "policies, or install the middleware once"
        for other in others
        for item, method, ours in found
        if (theirs := other.policy_for(method, item)) is not None and theirs != ours
    ]


#: A middleware's settings besides its policies, as each shows on it.
_SETTINGS: tuple[tuple[str, Callable[[Any], object]], ...] = (
    ("tenant_resolver", lambda mw: mw.tenant_resolver),
    ("problem_base", lambda mw: mw.problem_base),
    ("www_authenticate", lambda mw: mw.tenants.challenge),
    ("status_path", lambda mw: mw.status_path),
    ("acquire_timeout", lambda mw: mw.acquire_timeout),
    ("max_waiters", lambda mw: mw.waiters.limit),
    ("max_tenant_connections", lambda mw: mw.tenant_slots.limit),
)


def ignored_settings(mw: IdempotencyMiddleware, app: Any, routes: Sequence[BaseRoute]) -> list[str]:
    """Warnings for each IdempotencyMiddleware inside `mw` (in the app's own stack, or mounted
    below it) made with other settings than `mw`'s: for every request `mw` guards, the inner one
    passes it on, so its store, tenant resolver, problem base and the rest never apply there.
    (`install()` called twice with two stores was taken without a word, found by probing.)
    Warned, not refused: two stores on one database, two resolvers alike, are common and work."""
    from .middleware import IdempotencyMiddleware  # (the middleware's startup imports this)

    ours = [
        m
        for m in _layers(getattr(app, "middleware_stack", None))
        if isinstance(m, IdempotencyMiddleware)
    ]
    below = ours[ours.index(mw) + 1 :] if mw in ours else []  # (one outside `mw` warns of it)
    inner = [(m, "in the app's middleware list") for m in below]
    apps: list[Any] = []
    inner += [(m, "in an app mounted below") for m, _ in mounted_middlewares(routes, apps=apps)]
    for app_below in apps:
        with contextlib.suppress(TypeError):
            _GUARDED_BELOW.add(app_below)
    warnings = []
    for other, where in inner:
        differ = [name for name, read in _SETTINGS if read(other) != read(mw)]
        if not same_records(other.store, mw.store):  # (two stores on one database: alike)
            differ.insert(0, "store")
        if differ:
            warnings.append(
                f"another IdempotencyMiddleware {where} has another {', '.join(differ)} than "
                "the one outside it: the outer one handles every request it guards, and the "
                f"inner one's settings ({', '.join(differ)}) never apply to them. Make them "
                "alike, or install the middleware once"
            )
    return warnings


def _described(policy: Policy | None) -> str:
    from .startup import describe  # (startup imports this module)

    return "unguarded" if policy is None else describe(policy)
