"""The route classes the route walk knows: Starlette's, and FastAPI's once the app imports it.

FastAPI is optional, and an `APIRoute` exists only once FastAPI is imported: importing it here
took 0.2 s of every start of the command line, which never needs it. `learn_fastapi`, called
before these sets are read, adds FastAPI's classes to them (in place: other modules hold them)
as soon as FastAPI is in `sys.modules`.
"""

from __future__ import annotations

import sys
from typing import Any

from starlette.routing import Host, Mount, Route, WebSocketRoute

#: FastAPI's `APIRoute`, once learned (else empty).
API_ROUTE: list[type[Any]] = []
#: FastAPI's `APIRoute.matches`, whose routes' contexts match by their own regex and methods.
API_MATCHES: set[Any] = set()
#: The `matches` of Starlette's `Route` and FastAPI's `APIRoute`: a route of a class that keeps
#: one of them (not a subclass with its own, which may take other methods) answers a method
#: outside its `methods` with PARTIAL at best, so `match_route` need not ask it.
PLAIN_MATCHES: set[Any] = {Route.matches}
#: Starlette's `Route` and FastAPI's `APIRoute`, exactly: a route of either class matches by its
#: path and methods alone (a pure `matches`), and includes no router.
PLAIN_ROUTES: set[type[Any]] = {Route}
#: The `matches` of classes whose path regex `_prefix` may read (Starlette's `Route` and
#: `Mount`, FastAPI's `APIRoute`): each matches the path, relative to the root path, with it.
SEGMENTED: set[Any] = {Route.matches, Mount.matches}
#: The `matches` whose answer depends only on what the middleware's route cache keys on (the
#: method, the path and root path, the Host header). A custom route class's may read anything
#: in the scope (a version header, say): a request matched past one is resolved every time.
PURE_MATCHES: set[Any] = {Route.matches, Mount.matches, Host.matches, WebSocketRoute.matches}


def learn_fastapi() -> None:
    """FastAPI's route classes added to the sets above, once FastAPI is imported."""
    if API_ROUTE:
        return
    routing = sys.modules.get("fastapi.routing")
    api_route = getattr(routing, "APIRoute", None)
    if api_route is None:
        return
    for name in ("APIWebSocketRoute", "_IncludedRouter"):
        matches = getattr(getattr(routing, name, None), "matches", None)
        if matches is not None:
            PURE_MATCHES.add(matches)
    PURE_MATCHES.add(api_route.matches)
    API_MATCHES.add(api_route.matches)
    PLAIN_MATCHES.add(api_route.matches)
    SEGMENTED.add(api_route.matches)
    PLAIN_ROUTES.add(api_route)
    API_ROUTE.append(api_route)  # (last: the sets are whole once it is there)
