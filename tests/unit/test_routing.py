"""routing.py: the route a request reaches and every route of an app, through Route, Mount,
Host, nested routers and middleware; tests/integration/test_routing.py runs them guarded."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, Host, Match, Mount, Route, Router, WebSocketRoute
from starlette.staticfiles import StaticFiles

from idem_middleware.policy import RouteMatch
from idem_middleware.routing import Found, Hidden, Unresolved, match_route, routes_of, walk


async def endpoint(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def socket(websocket: Any) -> None:
    raise AssertionError("never called")


class CustomRoute(BaseRoute):
    """A route class the middleware cannot name: it matches everything and has no path."""

    endpoint = staticmethod(endpoint)

    def matches(self, scope: Any) -> tuple[Match, dict[str, Any]]:
        return Match.FULL, {"endpoint": endpoint}


INNER = Router([Route("/items/{item_id}", endpoint, methods=["POST"])])
APP = Starlette(
    routes=[
        Route("/pay", endpoint, methods=["POST"]),
        WebSocketRoute("/ws", socket),
        Mount("/v1", routes=[Mount("/shop", app=INNER)]),
        Host("api.example", app=Router([Route("/pay", endpoint, methods=["POST"])])),
        Mount("/wrapped", app=GZipMiddleware(Router([Route("/x", endpoint, methods=["POST"])]))),
        Mount("/static", app=StaticFiles(directory=".", check_dir=False)),
    ]
)


def http(path: str, method: str = "POST", host: str = "test") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "headers": [(b"host", host.encode())],
    }


def test_routes_of_looks_through_middleware() -> None:
    assert routes_of(APP) is APP.router.routes
    assert routes_of(GZipMiddleware(INNER)) is INNER.routes
    assert routes_of(StaticFiles(directory=".", check_dir=False)) is None


def test_match_route_names_the_template_with_every_prefix() -> None:
    routes = APP.router.routes
    match = match_route(routes, http("/v1/shop/items/7"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/v1/shop/items/{item_id}"
    assert match.path_params == {"item_id": "7"}
    assert match.endpoint is endpoint
    assert match_route(routes, http("/pay")).template == "/pay"  # type: ignore[union-attr]
    assert match_route(routes, http("/wrapped/x")).template == "/wrapped/x"  # type: ignore[union-attr]


def test_a_host_is_part_of_the_template() -> None:
    match = match_route(APP.router.routes, http("/nope", host="api.example"))
    assert match is None
    only_host = [APP.router.routes[3]]
    found = match_route(only_host, http("/pay", host="api.example"))
    assert isinstance(found, RouteMatch)
    assert found.template == "api.example/pay"


def test_no_match_a_wrong_method_and_an_unseen_app_are_none() -> None:
    routes = APP.router.routes
    assert match_route(routes, http("/missing")) is None
    assert match_route(routes, http("/pay", method="GET")) is None, "the app's 405, not ours"
    assert match_route(routes, http("/static/file.txt", method="GET")) is None


def test_a_route_without_a_path_is_unresolved() -> None:
    match = match_route([CustomRoute()], http("/custom"))
    assert isinstance(match, Unresolved)
    assert "CustomRoute" in match.where


def test_walk_lists_every_route_in_router_order() -> None:
    listed = list(walk(APP.router.routes))
    found = [(f.template, f.methods) for f in listed if isinstance(f, Found)]
    assert found == [
        ("/pay", frozenset({"POST"})),
        ("/v1/shop/items/{item_id}", frozenset({"POST"})),
        ("api.example/pay", frozenset({"POST"})),
        ("/wrapped/x", frozenset({"POST"})),
    ]
    (hidden,) = [h for h in listed if isinstance(h, Hidden)]
    assert hidden.where == "/static (a mounted StaticFiles)"
    assert not hidden.unresolvable
    (custom,) = walk([CustomRoute()])
    assert isinstance(custom, Hidden)
    assert custom.unresolvable


class OverrideRoute(Route):
    """A route class with its own `matches` that takes POST for a GET route (a method-override
    convention): it must still be asked, whatever its `methods` say."""

    def matches(self, scope: Any) -> tuple[Match, dict[str, Any]]:
        match, child = super().matches({**scope, "method": "GET"})
        return match, child


def test_a_route_class_with_its_own_matches_is_asked_whatever_its_methods() -> None:
    routes = [
        Route("/pay", endpoint, methods=["GET"]),
        OverrideRoute("/pay", endpoint, methods=["GET"]),
    ]
    match = match_route(routes, http("/pay"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/pay"


def test_routes_of_other_methods_are_not_asked() -> None:
    """A miss of the middleware's route cache (a path with a fresh id) asks only the routes that
    can take the request's method; the others could only answer PARTIAL."""
    asked: list[str] = []

    def spy(route: Route) -> Route:
        plain = route.matches

        def matches(scope: Any) -> tuple[Match, dict[str, Any]]:
            asked.append(route.path)
            return plain(scope)

        route.matches = matches  # type: ignore[method-assign]
        return route

    routes: list[BaseRoute] = [
        spy(Route("/docs", endpoint, methods=["GET"])),
        spy(Route("/pay/{id}", endpoint, methods=["GET"])),
        spy(Route("/other", endpoint, methods=["POST"])),
        spy(Route("/pay/{id}", endpoint, methods=["POST"])),
    ]
    match = match_route(routes, http("/pay/7"))
    assert isinstance(match, RouteMatch)
    assert match.path_params == {"id": "7"}
    assert asked == ["/pay/{id}"]  # ("/other" neither: its paths start with another segment)
    asked.clear()
    assert match_route(routes, http("/pay/7", method="DELETE")) is None, "the app's 405"
    assert asked == []


def test_a_route_added_to_the_list_is_found_by_the_next_request() -> None:
    routes: list[BaseRoute] = [
        Route("/a", endpoint, methods=["POST"]),
        Route("/x", endpoint, methods=["GET"]),
    ]
    assert match_route(routes, http("/b")) is None
    routes.append(Route("/b", endpoint, methods=["POST"]))
    match = match_route(routes, http("/b"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/b"
