"""Which route a request reaches, through every routing construct Starlette and FastAPI offer
(Route, Mount, Host, nested Routers, included APIRouters, mounted applications), and every route
of an app listed the same way (for the startup checks and the CLI).

A template is the route's path with every enclosing mount's prefix; under a `Host` it starts
with the host pattern (`api.example/pay`), so two hosts' `/pay` are two operations.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.routing import BaseRoute, Host, Match, Mount, Route, Router, WebSocketRoute
from starlette.types import Scope

from .body_limits import declared_limit, mounted_limit, tighter
from .policy import RouteMatch
from .route_cache import Trace
from .route_candidates import (
    Memo,
    ask_as_fastapi,
    candidates_and_filed,
    included_candidates,
    own_matches,
    route_path,
)
from .route_classes import PLAIN_ROUTES

_CONVERTER = re.compile(r":\w+}")
_NONE: frozenset[int] = frozenset()

#: How many wrapping middlewares (`.app`, as Starlette's own keep it) are looked through.
_MAX_WRAPPERS = 32


def _memo(trace: Trace | None) -> Memo | None:
    return None if trace is None else trace.memo


def _limit(obj: Any, memo: Memo | None) -> int | None:
    return declared_limit(obj, None if memo is None else memo.limits)


@dataclass(frozen=True, slots=True)
class Unresolved:
    """The request reaches a route the middleware cannot name (a custom route class without a
    path): it is refused when it would be guarded, never run unguarded."""

    where: str
    endpoint: Any


@dataclass(frozen=True, slots=True)
class Found:
    """One route of the app, as `walk` lists it."""

    template: str
    #: None: any method (a Route whose endpoint is an ASGI application).
    methods: frozenset[str] | None
    endpoint: Any
    #: The route itself (FastAPI's carries its `dependant`).
    route: Any
    #: The path as OpenAPI writes it: no converters (`/items/{item_id}`), no host.
    path_format: str = ""


@dataclass(frozen=True, slots=True)
class Hidden:
    """A part of the app whose routes cannot be seen (a mounted static-files or WSGI app) or
    named (a custom route class without a path)."""

    where: str
    endpoint: Any
    #: True: a custom route a request can reach (and is refused when it would be guarded).
    unresolvable: bool


def routes_of(app: Any) -> Sequence[BaseRoute] | None:
    """The routes an ASGI app dispatches to: a Router's, a Starlette or FastAPI app's, or those
    of a router behind middleware that wraps it; a route served as an app (`Host("h", app=Mount(
    "/v2", ...))`) is that one route. None when they cannot be seen."""
    if isinstance(app, BaseRoute):
        return (app,)  # (it matches the request itself, its own path included, or answers 404)
    router = router_of(app)
    return None if router is None else router.routes


def router_of(app: Any) -> Router | None:
    """The Router an ASGI app dispatches with (see `routes_of`); None when it cannot be seen."""
    for _ in range(_MAX_WRAPPERS):
        if isinstance(app, Router):
            return app
        if isinstance(app, BaseRoute):
            return None  # (what it routes to is below its own match: see routes_of)
        router = getattr(app, "router", None)
        if isinstance(router, Router):
            return router
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def mounted_app(route: Mount | Host) -> Any:
    """What a Mount or Host dispatches to, below the Mount's own `middleware=[...]`: one that
    keeps what it wraps to itself (no `app`) must not hide routes it still reaches."""
    return getattr(route, "_base_app", route.app)


def app_below(middleware: Any, app: Any) -> Any:
    """The app whose routes `middleware` guards: the request's app (`scope["app"]`) when the
    middleware is in that app's own stack, else the app it wraps (`middleware.app`). Never an
    app that mounts the middleware (`Mount("/v1", app=IdempotencyMiddleware(sub))`): that
    app's router is above it, none of its routes match, and nothing was guarded."""
    if app is not None:
        inner = getattr(app, "middleware_stack", None)
        for _ in range(_MAX_WRAPPERS):
            if inner is None or inner is middleware:
                break
            inner = getattr(inner, "app", None)
        if inner is middleware:
            return app
    return middleware.app


def _no_converters(path: str) -> str:
    """`/users/{id:int}` as OpenAPI writes it: `/users/{id}` (a Mount's `path_format` has its
    `/{path}` tail)."""
    return _CONVERTER.sub("}", path)


def _included(route: BaseRoute) -> list[Any] | None:
    """The routes of an APIRouter that newer FastAPI includes as one route (`_IncludedRouter`),
    each with its prefixed path; None for any other route."""
    contexts = getattr(route, "effective_route_contexts", None)
    return list(contexts()) if callable(contexts) else None


#: `_match_included`'s answer when none of the router's routes matches FULL.
_NONE_FULL = Unresolved("", None)


def _match_included(
    contexts: Sequence[Any], scope: Scope, prefix: str, trace: Trace | None, limit: Limits
) -> RouteMatch | Unresolved | None:
    """The first of an included router's routes to match FULL, named; `_NONE_FULL` if none
    does (None: the one that does dispatches to an app whose routes cannot be seen)."""
    for context in contexts:
        if own_matches(context):
            match, child = ask_as_fastapi(context, scope, trace)
        else:
            match, child = context.matches(scope)
        if match is not Match.FULL:
            continue
        if context.starlette_route is not None:  # a Starlette route or mount, prefixed
            return match_route([context.starlette_route], scope, prefix, trace, limit)
        return RouteMatch(
            prefix + context.path,
            child.get("path_params", {}),
            child.get("endpoint", context.endpoint),
            *_within(_limit(context, _memo(trace)), limit),
        )
    return _NONE_FULL


#: The body limits on the way to a route: the innermost declared, and the least (see tighter).
Limits = tuple[int | None, int | None]
_NO_LIMITS: Limits = (None, None)


def _within(declared: int | None, limits: Limits) -> Limits:
    if declared is None:
        return limits
    return declared, tighter(declared, limits[1])


def match_route(
    routes: Sequence[BaseRoute],
    scope: Scope,
    prefix: str = "",
    trace: Trace | None = None,
    limit: Limits = _NO_LIMITS,
    router: Router | None = None,
) -> RouteMatch | Unresolved | None:
    """The route the router will dispatch to, found the way Starlette's router finds it.

    Only a FULL match counts: a path whose route rejects the method is the app's 405, not ours.
    None: nothing matches, or the request goes to an application whose routes cannot be seen.
    Only the routes the request can reach are asked (`route_candidates`: by the method, and by
    the literal segments their paths start with). `trace` collects what the answer depended on
    (see Trace); `limit`, the body limit the enclosing mounts declare (see body_limits);
    `router`, the Router whose `routes` they are, if known (see Trace.walked).
    """
    memo = None if trace is None else trace.memo
    reachable, filed = candidates_and_filed(routes, scope, memo)
    if trace is not None:
        trace.walked(routes, router)
        for lists in filed:  # (the lists of routers it may not ask: see there)
            trace.walked(lists)
    for route in reachable:
        # (Starlette's Route or FastAPI's APIRoute itself, most routes, is asked only `matches`:
        # it includes no router, and its `matches` is pure.)
        if type(route) not in PLAIN_ROUTES:
            if trace is not None:
                trace.asked(route)
            if (contexts := included_candidates(route, scope, memo)) is not None:
                # FastAPI's included router: its routes (those of routers it includes too), each
                # as it matches under the router, in the order FastAPI asks them. The router
                # matches FULL exactly when one of them does, and dispatches to the first: found
                # without asking the router (it would walk them as well, at twice the cost).
                named = _match_included(contexts, scope, prefix, trace, limit)
                if named is _NONE_FULL:
                    continue
                return named
        match, child = route.matches(scope)
        if match is not Match.FULL:
            continue
        if isinstance(route, Route):
            # (`_limit`, its memo read inline: a route is matched at each miss of the cache)
            known = None if memo is None else memo.limits.get(id(route))
            declared = known[1] if known is not None and known[0] is route else _limit(route, memo)
            found = limit if declared is None else (declared, tighter(declared, limit[1]))
            return RouteMatch(prefix + route.path, child["path_params"], child["endpoint"], *found)
        if (contexts := _included(route)) is not None:  # (a FastAPI that keeps them otherwise)
            named = _match_included(contexts, scope, prefix, trace, limit)
            return None if named is _NONE_FULL else named
        if isinstance(route, Mount | Host):
            inner = routes_of(mounted := mounted_app(route))
            if inner is None:
                return None
            own = _within(_limit(route, memo), limit)
            limit = _within(mounted_limit(mounted, memo=memo), own)
            below = None if isinstance(mounted, BaseRoute) else router_of(mounted)
            if isinstance(route, Mount):
                mounted_at = prefix + route.path
                return match_route(inner, {**scope, **child}, mounted_at, trace, limit, below)
            hosted = route.host + prefix
            return match_route(inner, {**scope, **child}, hosted, trace, limit, below)
        endpoint = child.get("endpoint", getattr(route, "endpoint", None))
        path = getattr(route, "path", None)
        if isinstance(path, str):
            found = _within(_limit(route, memo), limit)
            return RouteMatch(prefix + path, child.get("path_params", {}), endpoint, *found)
        return Unresolved(f"a {type(route).__name__} under {prefix or '/'}", endpoint)
    if trace is not None and router is not None:
        trace.fell_through(router)
    fallback = default_app(router)
    if (
        fallback is not None
        and (inner := routes_of(fallback)) is not None
        and inner is not routes
        and _handed_on(router, routes, scope, trace)
    ):
        # No route matched: the router hands the request to its `default` app as it is.
        below = None if isinstance(fallback, BaseRoute) else router_of(fallback)
        limit = _within(mounted_limit(fallback, memo=memo), limit)
        return match_route(inner, scope, prefix, trace, limit, below)
    return None


def _handed_on(router: Any, routes: Sequence[Any], scope: Scope, trace: Trace | None) -> bool:
    """Whether a router with no FULL match hands the request to its default app, as Starlette's
    does: not if a route takes it in part (a 405), or its path with a slash added or taken away
    matches (`redirect_slashes`: a redirect)."""
    low_priority = getattr(router, "_match_low_priority", None)  # (FastAPI's, before its default)
    if callable(low_priority):
        with contextlib.suppress(Exception):
            if low_priority(scope)[0] is not Match.NONE:
                return False
    other = None
    path, within = scope.get("path", ""), route_path(scope)
    if getattr(router, "redirect_slashes", False) and within != "/":
        other = {**scope, "path": path.rstrip("/") if within.endswith("/") else path + "/"}
    for route in routes:
        if trace is not None and type(route) not in PLAIN_ROUTES:
            trace.asked(route)
        if route.matches(scope)[0] is not Match.NONE:
            return False
        if other is not None and route.matches(other)[0] is not Match.NONE:
            return False
    return True


class DefaultMount(Mount):
    """A router's default app, listed as a Mount in the router's place, after its routes."""


def listed_routes(app: Any) -> Sequence[BaseRoute] | None:
    """`routes_of(app)`, and its router's default app after them (`match_route` finds requests
    there as the router hands them on): what startup, the CLI and OpenAPI list."""
    routes = routes_of(app)
    default = None if routes is None else default_app(router_of(app))
    if routes is None or default is None:
        return routes
    return [*routes, DefaultMount("", app=default)]


def default_app(router: Any) -> Any:
    """A Router's `default` app, where a request no route matches goes; None for its own 404."""
    default = getattr(router, "default", None)
    return None if getattr(default, "__func__", None) is Router.not_found else default


def routed_above(scope: Scope, found: RouteMatch, trace: Trace | None = None) -> RouteMatch:
    """`found`, matched in the app this middleware wraps, named as the router above it routed
    the request: a sub-app with its own middleware, mounted at `/v1` (or under a `Host`), sees
    only its own `/pay`, and two such sub-apps must not share the operation `POST /pay`.
    Starlette's first router leaves itself in `scope["router"]` and the root path it started
    from in `app_root_path`; the match is made again from there. When that router's view does
    not reach this app (a wrapper that hides it), the concrete path the mounts took is the
    prefix: more operations than templates, never one for two routes."""
    routes = getattr(scope.get("router"), "routes", None)
    root_path = scope.get("root_path", "")
    app_root_path = scope.get("app_root_path", root_path)
    if routes is not None:
        limit = _within(_limit(scope["router"], _memo(trace)), _NO_LIMITS)
        above = {**scope, "root_path": app_root_path}
        top = match_route(routes, above, "", trace, limit, scope["router"])
        if isinstance(top, RouteMatch) and top.endpoint is found.endpoint:
            return top
    mounted = root_path[len(app_root_path) :] if root_path.startswith(app_root_path) else ""
    if "\x00" in mounted or "\\" in mounted:
        # A client's `%00` would reach PostgreSQL's `text`, which refuses NUL: escaped, with the
        # backslash the escape starts with, so that no two paths share a name.
        mounted = mounted.replace("\\", "\\\\").replace("\x00", "\\0")
    limits = found.body_limit, found.least_limit
    return RouteMatch(mounted + found.template, found.path_params, found.endpoint, *limits)


def walk(
    routes: Sequence[BaseRoute], prefix: str = "", shown: str = "", above: frozenset[int] = _NONE
) -> Iterator[Found | Hidden]:
    """Every route of the app with its template, in the order the router tries them. `shown`
    is the enclosing mounts' prefix as OpenAPI writes it (see Found.path_format); `above`, the
    mounted apps on the way down (a default app that leads back up is not walked again)."""
    for route in routes:
        if isinstance(route, WebSocketRoute):
            continue  # never guarded
        if isinstance(route, Route):
            methods = frozenset(route.methods) if route.methods is not None else None
            yield Found(
                prefix + route.path, methods, route.endpoint, route, shown + route.path_format
            )
        elif (contexts := _included(route)) is not None:
            for context in contexts:
                if context.starlette_route is not None:
                    yield from walk([context.starlette_route], prefix, shown)
                else:
                    found = frozenset(context.methods or ()) or None
                    yield Found(
                        prefix + context.path,
                        found,
                        context.endpoint,
                        context,
                        shown + context.path_format,
                    )
        elif isinstance(route, Mount | Host):
            if isinstance(route, Mount):
                path, inner_shown = prefix + route.path, shown + _no_converters(route.path)
            else:
                path, inner_shown = route.host + prefix, shown
            if id(mounted := mounted_app(route)) in above:
                continue
            inner = listed_routes(mounted)
            if inner is None:
                named = f"{path or '/'} (a mounted {type(mounted).__name__})"
                if isinstance(route, DefaultMount):
                    named = "the router's default app" + (f" under {path}" if path else "")
                yield Hidden(named, None, False)
            else:
                yield from walk(inner, path, inner_shown, above | {id(mounted)})
        else:
            endpoint = getattr(route, "endpoint", None)
            custom_path = getattr(route, "path", None)
            if isinstance(custom_path, str):
                methods = getattr(route, "methods", None)
                shown_path = shown + getattr(route, "path_format", custom_path)
                methods = frozenset(methods) if methods else None
                yield Found(prefix + custom_path, methods, endpoint, route, shown_path)
            else:
                yield Hidden(f"a {type(route).__name__} under {prefix or '/'}", endpoint, True)
