"""Which of a list of routes can match a request FULL, found once per list and method: the
routes the middleware asks, in the router's order (`routing.match_route`), when its route cache
does not have the request's path."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Mount, Route
from starlette.types import Scope


def _plain_matches() -> frozenset[Any]:
    """The `matches` of Starlette's `Route` and FastAPI's `APIRoute`: a route of a class that
    keeps one of them (not a subclass with its own, which may take other methods) answers a
    method outside its `methods` with PARTIAL at best, so `match_route` need not ask it."""
    found: set[Any] = {Route.matches}
    try:
        from fastapi.routing import APIRoute
    except ImportError:  # pragma: no cover - FastAPI is optional
        pass
    else:
        found.add(APIRoute.matches)
    return frozenset(found)


_PLAIN_MATCHES = _plain_matches()


try:
    from starlette._utils import get_route_path as _route_path
except ImportError:  # pragma: no cover - a Starlette without it: every candidate is asked
    _route_path = None  # type: ignore[assignment]

#: The `matches` of classes whose path regex `_segment` may read (Starlette's `Route` and
#: `Mount`, FastAPI's `APIRoute`): each matches the path, relative to the root path, with it.
_SEGMENTED = _PLAIN_MATCHES | {Mount.matches}


def _segment(route: BaseRoute) -> str | None:
    """The literal first segment of every path `route` can match (`/accounts/{id}` and the
    mount `/accounts`: "accounts"); None when it has none, or its regex cannot be seen to
    require it (a parameter in that segment, a custom route class, a regex of another shape)."""
    if type(route).matches not in _SEGMENTED:
        return None
    path, regex = getattr(route, "path", None), getattr(route, "path_regex", None)
    if not isinstance(path, str) or not isinstance(regex, re.Pattern) or regex.flags & re.I:
        return None
    first = path[1:].split("/", 1)[0]
    if not path.startswith("/") or not first or "{" in first:
        return None
    # Starlette compiles the text before the first parameter with `re.escape`: a pattern that
    # starts so can match only paths whose first segment is `first`.
    escaped = "^/" + re.escape(first)
    if regex.pattern.startswith(escaped + "/") or regex.pattern == escaped + "$":
        return first
    return None


#: Per list of routes and method, what `_candidates` answers: the list and its length then, the
#: routes a request with that method can match FULL, and those of them by the first segment of
#: the paths they can match (with the routes that have none, in order).
_CANDIDATES: dict[
    tuple[int, str],
    tuple[Sequence[BaseRoute], int, tuple[BaseRoute, ...], dict[str, tuple[BaseRoute, ...]]],
] = {}


def candidates(routes: Sequence[BaseRoute], scope: Scope) -> Sequence[BaseRoute]:
    """`routes` less those that cannot match the request FULL: routes of a class that matches
    as Starlette's `Route` does (`_PLAIN_MATCHES`) whose `methods` exclude its method, and
    routes whose paths all start with another segment than the request's (`_segment`: a large
    app's routes are not all asked, once for every new path). Worked out once per list and
    method (again if the list's length changes); under FastAPI's included routers (a "fastapi"
    entry in the scope, which can make an `APIRoute` match as its included copy) every route is
    asked."""
    method = scope.get("method")
    if len(routes) < 2 or not isinstance(method, str) or "fastapi" in scope:
        return routes
    cache_key = (id(routes), method)
    cached = _CANDIDATES.get(cache_key)
    if cached is None or cached[0] is not routes or cached[1] != len(routes):
        cached = _CANDIDATES[cache_key] = _candidates_of(routes, method)
    kept, by_segment = cached[2], cached[3]
    if not by_segment or _route_path is None:
        return kept
    # (Every entry holds the routes of no segment: a path not starting with `/`, which no
    # route with one can match, finds them whatever its "segment".)
    path = _route_path(scope)
    end = path.find("/", 1)
    return by_segment.get(path[1:] if end < 0 else path[1:end], by_segment[""])


def _candidates_of(
    routes: Sequence[BaseRoute], method: str
) -> tuple[Sequence[BaseRoute], int, tuple[BaseRoute, ...], dict[str, tuple[BaseRoute, ...]]]:
    kept = tuple(
        route
        for route in routes
        if not (
            (methods := getattr(route, "methods", None))
            and method not in methods
            and type(route).matches in _PLAIN_MATCHES
        )
    )
    segments = [_segment(route) for route in kept]
    by_segment: dict[str, tuple[BaseRoute, ...]] = {}
    if any(segments):  # "": the routes of no segment, for a path whose segment has none
        for first in {"", *filter(None, segments)}:
            by_segment[first] = tuple(
                route for route, seg in zip(kept, segments, strict=True) if seg in (None, first)
            )
    if len(_CANDIDATES) >= 1024:
        _CANDIDATES.clear()  # lists made and dropped at run time: start over
    return routes, len(routes), kept, by_segment
