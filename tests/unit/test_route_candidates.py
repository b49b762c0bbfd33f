"""route_candidates.py: a miss of the middleware's route cache (a path with a new id in it) asks
only the routes that can match the request: those that take its method, and whose paths start
with its first segment (or can start with any). The router's choice is unchanged: the first
route, in its order, that matches FULL."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, Host, Match, Mount, Route, Router

from idem_middleware.policy import RouteMatch
from idem_middleware.route_candidates import Memo, candidates
from idem_middleware.routing import Trace, match_route


async def endpoint(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def http(path: str, method: str = "POST", root_path: str = "") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": root_path,
        "headers": [(b"host", b"test")],
    }


class Spied(Route):
    """A Route that records each time it is asked (its `matches` is Route's own)."""

    def __init__(self, path: str, asked: list[str], **options: Any) -> None:
        super().__init__(path, endpoint, **options)
        self.asked = asked

    def __getattribute__(self, name: str) -> Any:
        if name == "matches":
            object.__getattribute__(self, "asked").append(object.__getattribute__(self, "path"))
        return object.__getattribute__(self, name)


def test_only_routes_of_the_paths_first_segment_and_those_of_any_are_asked() -> None:
    asked: list[str] = []
    routes: list[BaseRoute] = [
        Spied("/things/{id}", asked, methods=["POST"]),
        Spied("/{tenant}/pay", asked, methods=["POST"]),  # any first segment
        Spied("/item-{id}", asked, methods=["POST"]),  # a parameter in the first segment
        Spied("/accounts/{id}/credits", asked, methods=["POST"]),
        Spied("/accounts", asked, methods=["POST"]),
    ]
    match = match_route(routes, http("/accounts/a1/credits"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/accounts/{id}/credits"
    assert asked == ["/{tenant}/pay", "/item-{id}", "/accounts/{id}/credits"]
    asked.clear()
    match = match_route(routes, http("/acme/pay"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/{tenant}/pay"
    assert asked == ["/{tenant}/pay"]


def test_a_route_of_any_segment_before_a_literal_one_still_wins() -> None:
    """The router's order holds across the two kinds: `/{tenant}/pay` comes first, so it takes
    `/accounts/pay` from `/accounts/pay`'s own route, as Starlette's router would."""
    routes: list[BaseRoute] = [
        Route("/{tenant}/pay", endpoint, methods=["POST"]),
        Route("/accounts/pay", endpoint, methods=["POST"]),
    ]
    match = match_route(routes, http("/accounts/pay"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/{tenant}/pay"


def test_mounts_are_found_by_their_first_segment_and_under_the_root_path() -> None:
    inner = Router([Route("/items/{id}", endpoint, methods=["POST"])])
    routes: list[BaseRoute] = [
        Route("/shop", endpoint, methods=["POST"]),
        Mount("/shop", app=inner),
        Mount("/v1/shop", app=inner),
    ]
    match = match_route(routes, http("/shop/items/3"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/shop/items/{id}"
    match = match_route(routes, http("/v1/shop/items/3"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/v1/shop/items/{id}"
    # The app served under a root path: the segment is read after it, as Starlette reads it.
    match = match_route(routes, http("/api/shop/items/3", root_path="/api"))
    assert isinstance(match, RouteMatch)
    assert match.template == "/shop/items/{id}"


@pytest.mark.parametrize(
    "route",
    [
        Host("api.example", app=Router([])),
        Mount("", app=Router([])),
        Route("/{id}", endpoint, methods=["POST"]),
    ],
)
def test_routes_without_a_literal_first_segment_are_asked_for_every_path(route: BaseRoute) -> None:
    routes = [Route("/a/{x}", endpoint, methods=["POST"]), route]
    for path in ("/a/1", "/b", "/", "//a/1", ""):
        assert route in candidates(routes, http(path)), path


def test_a_route_whose_regex_is_not_its_paths_is_asked_for_every_path() -> None:
    """A route whose `path` and `path_regex` disagree (changed after it was made) is not read
    for a segment: its regex decides, as the router's does."""
    route = Route("/a/{x}", endpoint, methods=["POST"])
    route.path = "/b/{x}"
    routes = [Route("/c", endpoint, methods=["POST"]), route]
    assert route in candidates(routes, http("/a/1"))
    match = match_route(routes, http("/a/1"))
    assert isinstance(match, RouteMatch)


# -- the router's choice, for any routes and any path ----------------------------------------

SEGMENTS = st.sampled_from(["a", "b", "a.b", "a-b", "{x}", "{y:int}", "x{z}", "", "A"])


@st.composite
def route_tables(draw: st.DrawFn) -> list[BaseRoute]:
    routes: list[BaseRoute] = []
    for _ in range(draw(st.integers(1, 8))):
        parts = draw(st.lists(SEGMENTS, min_size=1, max_size=3))
        names = iter(f"p{i}" for i in range(10))
        path = "/" + "/".join(
            p.replace("{x}", f"{{{next(names)}}}")
            .replace("{y:int}", f"{{{next(names)}:int}}")
            .replace("{z}", f"{{{next(names)}}}")
            for p in parts
        )
        kind = draw(st.sampled_from(["route", "get", "mount"]))
        if kind == "mount" and path.rstrip("/"):
            inner = Router([Route("/{rest:path}", endpoint, methods=["POST"])])
            routes.append(Mount(path, app=inner))
        else:
            routes.append(Route(path, endpoint, methods=["GET" if kind == "get" else "POST"]))
    return routes


PATHS = st.lists(st.sampled_from(["a", "b", "a.b", "a-b", "7", "", "A", "xz"]), max_size=4).map(
    lambda parts: "/" + "/".join(parts)
)


@settings(max_examples=300, deadline=None)
@given(routes=route_tables(), path=PATHS, root=st.sampled_from(["", "/a"]))
def test_the_route_found_is_the_first_the_router_matches_fully(
    routes: list[BaseRoute], path: str, root: str
) -> None:
    scope = http(root + path if root else path, root_path=root)
    first_full = next((r for r in routes if r.matches(scope)[0] is Match.FULL), None)
    asked = candidates(routes, scope)
    # Every route that matches FULL is asked, in the router's order.
    assert [r for r in routes if r.matches(scope)[0] is Match.FULL] == [
        r for r in asked if r.matches(scope)[0] is Match.FULL
    ]
    match = match_route(routes, scope)
    if first_full is None:
        assert match is None
    else:
        assert isinstance(match, RouteMatch)
        if isinstance(first_full, Route):
            assert match.template == first_full.path


# -- FastAPI's included routers -----------------------------------------------------------------


def included_app(dispatched: list[str]) -> Any:
    """Routers included in routers, a path two of them both take, a Starlette route inside one;
    each endpoint records that the app dispatched to it."""
    fastapi = pytest.importorskip("fastapi")

    def endpoint_named(name: str) -> Any:
        async def handler() -> dict[str, str]:
            dispatched.append(name)
            return {}

        return handler

    app = fastapi.FastAPI()
    inner = fastapi.APIRouter(prefix="/inner")
    inner.post("/{id}/pay")(endpoint_named("inner"))
    first = fastapi.APIRouter()
    first.post("/orders/{id}")(endpoint_named("first-orders"))
    first.include_router(inner, prefix="/nested")
    second = fastapi.APIRouter()
    second.post("/orders/{id}")(endpoint_named("second-orders"))  # never: first's comes first
    second.post("/refunds/{id}")(endpoint_named("second-refunds"))

    async def plain(request: Any) -> PlainTextResponse:
        dispatched.append("starlette")
        return PlainTextResponse("ok")

    second.routes.append(Route("/plain/{id}", plain, methods=["POST"]))
    app.include_router(first, prefix="/api")
    app.include_router(second, prefix="/api")
    app.post("/tail/{id}")(endpoint_named("tail"))
    return app


@pytest.mark.parametrize(
    "path",
    [
        "/api/orders/1",
        "/api/refunds/2",
        "/api/nested/inner/3/pay",
        "/api/plain/4",
        "/tail/5",
        "/api/nowhere",
        "/elsewhere/1",
    ],
)
async def test_an_included_routers_route_is_the_one_fastapi_dispatches_to(path: str) -> None:
    dispatched: list[str] = []
    app = included_app(dispatched)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {**http(path), "query_string": b"", "app": app}
    await app(dict(scope), receive, send)
    match = match_route(app.router.routes, http(path))
    if not dispatched:
        assert sent[0]["status"] == 404
        assert match is None
        return
    assert isinstance(match, RouteMatch)
    assert match.endpoint.__name__ in ("handler", "plain")
    (ran,) = dispatched
    dispatched.clear()
    await match.endpoint(*(() if ran != "starlette" else (None,)))
    assert dispatched == [ran]


def test_an_included_router_is_not_asked_to_match_before_its_routes_are() -> None:
    """FastAPI's included router walks its routes to answer `matches`; the middleware walks them
    itself (once, not twice) for a path its route cache does not have."""
    fastapi_routing = pytest.importorskip("fastapi.routing")
    app = included_app([])
    calls: list[Any] = []
    original = fastapi_routing._IncludedRouter.matches

    def counted(self: Any, scope: Any) -> Any:
        calls.append(self)
        return original(self, scope)

    fastapi_routing._IncludedRouter.matches = counted
    try:
        for path in ("/api/refunds/2", "/api/nested/inner/3/pay", "/tail/5", "/api/nowhere"):
            match_route(app.router.routes, http(path))
    finally:
        fastapi_routing._IncludedRouter.matches = original
    assert calls == []


def test_an_included_routers_routes_are_asked_by_their_literal_segments() -> None:
    """Under a shared prefix (`/api/v1`), the segments after it tell the routes apart: a new
    path asks only the routes whose literal segments lead to it, and those with a parameter
    where it branches, in FastAPI's order; a route added later is found."""
    fastapi = pytest.importorskip("fastapi")
    fastapi_routing = pytest.importorskip("fastapi.routing")
    app = fastapi.FastAPI()
    router = fastapi.APIRouter()
    for name in ("accounts", "orders", "refunds"):
        router.post(f"/{name}/{{id}}/pay")(endpoint)
    router.post("/{tenant}/pay")(endpoint)
    router.get("/refunds/{id}/pay")(endpoint)
    app.include_router(router, prefix="/api/v1")
    asked: list[str] = []
    original = fastapi_routing._EffectiveRouteContext.matches

    def counted(self: Any, scope: Any) -> Any:
        asked.append(self.path)
        return original(self, scope)

    fastapi_routing._EffectiveRouteContext.matches = counted
    try:
        match = match_route(app.router.routes, http("/api/v1/refunds/7/pay"))
        assert isinstance(match, RouteMatch)
        assert match.template == "/api/v1/refunds/{id}/pay"
        assert asked == ["/api/v1/refunds/{id}/pay"]
        asked.clear()
        match = match_route(app.router.routes, http("/api/v1/acme/pay"))
        assert isinstance(match, RouteMatch)
        assert match.template == "/api/v1/{tenant}/pay"
        assert asked == ["/api/v1/{tenant}/pay"]
        asked.clear()
        router.post("/late/{id}")(endpoint)
        match = match_route(app.router.routes, http("/api/v1/late/1"))
        assert isinstance(match, RouteMatch)
        assert match.template == "/api/v1/late/{id}"
    finally:
        fastapi_routing._EffectiveRouteContext.matches = original


@st.composite
def fastapi_apps(draw: st.DrawFn) -> tuple[Any, list[str]]:
    """A FastAPI app of routes and included routers (some nested, with prefixes), POST and GET
    routes on paths of a few segments, literal or not; each endpoint, when FastAPI runs it,
    records its name in the list returned with the app."""
    fastapi = pytest.importorskip("fastapi")
    ran: list[str] = []
    count = iter(range(1000))

    def path(parts: list[str]) -> str:
        params = iter(f"p{i}" for i in range(10))
        return "/" + "/".join(
            part.replace("{x}", f"{{{next(params)}}}")
            .replace("{y:int}", f"{{{next(params)}:int}}")
            .replace("{z}", f"{{{next(params)}}}")
            for part in parts
        )

    def add(target: Any) -> None:
        for _ in range(draw(st.integers(1, 4))):
            route_path = path(draw(st.lists(SEGMENTS, min_size=1, max_size=3)))
            name = f"{route_path} #{next(count)}"

            async def handler(request: Request) -> dict[str, str]:
                ran.append(request.scope["endpoint"].__name__)
                return {}

            handler.__name__ = name
            method = draw(st.sampled_from(["post", "get"]))
            getattr(target, method)(route_path)(handler)

    app = fastapi.FastAPI()
    add(app)
    for _ in range(draw(st.integers(0, 3))):
        router = fastapi.APIRouter()
        add(router)
        if draw(st.booleans()):
            inner = fastapi.APIRouter()
            add(inner)
            router.include_router(inner, prefix=draw(st.sampled_from(["", "/a", "/b"])))
        app.include_router(router, prefix=draw(st.sampled_from(["", "/a", "/a/b", "/A"])))
    add(app)
    return app, ran


@settings(max_examples=150, deadline=None)
@given(built=fastapi_apps(), path=PATHS)
def test_the_route_found_is_the_one_fastapi_dispatches_to(
    built: tuple[Any, list[str]], path: str
) -> None:
    """Whatever FastAPI runs for a POST, the middleware names that route; when FastAPI runs
    nothing (404, 405, a redirect), the middleware names none."""
    app, ran = built
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    ran.clear()
    asyncio.run(app({**http(path), "query_string": b"", "app": app}, receive, send))
    match = match_route(app.router.routes, http(path))
    if not ran:
        assert sent[0]["status"] in (404, 405, 307), sent[0]
        assert not isinstance(match, RouteMatch), (path, match)
        return
    assert isinstance(match, RouteMatch), (path, ran)
    assert match.endpoint.__name__ == ran[0]


def test_an_app_made_at_run_time_is_not_kept_alive_by_what_its_misses_worked_out() -> None:
    """The tries a miss walks are the middleware's, and go with its app (kept for every app in
    the module, they kept each app made at run time alive: its routes, its store)."""
    import gc
    import weakref

    fastapi = pytest.importorskip("fastapi")
    from idem_middleware import IdempotencyMiddleware, MemoryStore

    def made_and_used() -> weakref.ref[Any]:
        app = fastapi.FastAPI()
        router = fastapi.APIRouter()

        async def ok() -> dict[str, str]:
            return {}

        for name in ("a", "b"):
            router.post(f"/{name}/{{id}}", status_code=201)(ok)
        app.include_router(router, prefix="/api")
        app.post("/flat/{id}", status_code=201)(ok)
        app.add_middleware(
            IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t"
        )
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        for path in ("/api/b/1", "/flat/2"):  # (misses: the tries are worked out)
            scope = {**http(path), "query_string": b"", "headers": [(b"idempotency-key", b"k")]}
            asyncio.run(app(scope, receive, send))
        assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [201, 201]
        return weakref.ref(app)

    ref = made_and_used()
    gc.collect()
    assert ref() is None


def _routers_app(fastapi: Any, *, prefixed: bool) -> tuple[Any, Any]:
    """Four routers of `/section<n>` routes and one of `/accounts/{id}/credits`, the way apps lay
    out a router per resource: under a prefix each, or (`prefixed=False`) with the prefix in
    each route's path. Returns the app and the first router."""
    app = fastapi.FastAPI()
    routers = [fastapi.APIRouter() for _ in range(5)]

    async def resource() -> dict[str, str]:
        return {}

    for n, router in enumerate(routers[:4]):
        route_prefix = "" if prefixed else f"/section{n}"
        router.post(f"{route_prefix}/things/{{thing_id}}")(resource)
        router.post(f"{route_prefix}/other/{{thing_id}}/do")(resource)
    routers[4].post(("" if prefixed else "/accounts") + "/{account_id}/credits")(resource)
    for n, router in enumerate(routers):
        prefix = ("/accounts" if n == 4 else f"/section{n}") if prefixed else ""
        app.include_router(router, prefix=prefix)
    return app, routers[0]


@pytest.mark.parametrize("prefixed", [True, False])
def test_included_routers_are_visited_only_under_the_segments_their_routes_share(
    prefixed: bool,
) -> None:
    """A new path visits only the included routers whose routes' paths all start as it does
    (each router filed by the literal segments they share), not every router at every miss."""
    fastapi = pytest.importorskip("fastapi")
    from idem_middleware import routing

    app, _ = _routers_app(fastapi, prefixed=prefixed)
    visited: list[Any] = []
    original = routing.included_candidates

    def counted(route: Any, scope: Any, memo: Any = None) -> Any:
        found = original(route, scope, memo)
        if found is not None:
            visited.append(route)
        return found

    routing.included_candidates = counted  # type: ignore[assignment]
    try:
        match = match_route(app.router.routes, http("/accounts/7/credits"))
        assert isinstance(match, RouteMatch)
        assert match.template == "/accounts/{account_id}/credits"
        assert [route.original_router.routes[0].path for route in visited] == [
            "/{account_id}/credits" if prefixed else "/accounts/{account_id}/credits"
        ]
        visited.clear()
        assert match_route(app.router.routes, http("/section2/things/3")) is not None
        assert len(visited) == 1
    finally:
        routing.included_candidates = original  # type: ignore[assignment]


async def test_a_route_added_to_a_router_the_path_did_not_visit_is_found() -> None:
    """A router filed under `/section0` (all its routes start so) is not visited for
    `/accounts/...`; a route added to it later that matches such a path is found, for a path the
    middleware's route cache has (the match depended on the router's routes staying as they
    were) and for a new one (the router is filed again). The added route comes first in
    FastAPI's order and is guarded where the other is not: missed, the request would pass
    unguarded."""
    fastapi = pytest.importorskip("fastapi")
    from starlette.middleware.authentication import AuthenticationMiddleware

    from idem_middleware import IdempotencyMiddleware, MemoryStore, idempotent
    from tests.apps.clients import BearerBackend, client

    app, first = _routers_app(fastapi, prefixed=False)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), methods=())  # guards none
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    async with client(app) as c:
        for account in ("1", "2"):
            for _ in range(2):  # (twice: the route cache keeps a path from its second request)
                assert (await c.post(f"/accounts/{account}/credits")).status_code == 200

        @idempotent()
        async def guarded(account_id: str) -> dict[str, str]:
            return {"guarded": account_id}

        first.post("/accounts/{account_id}/credits")(guarded)
        for account in ("1", "3"):  # the path the cache has, and a new one
            answer = await c.post(f"/accounts/{account}/credits")
            assert answer.status_code == 400, (account, answer.text)
            assert answer.json()["type"].endswith("missing-key")
            keyed = await c.post(
                f"/accounts/{account}/credits", headers={"idempotency-key": f"k-{account}"}
            )
            assert keyed.json() == {"guarded": account}


async def test_a_router_given_a_new_route_list_is_read_again() -> None:
    """The app's router and its routes are found once per app; a route list put in its place at
    run time (`app.router.routes = [...]`) is read at the next new path: read from the old list,
    a guarded route of the new one would be passed on unguarded."""
    from starlette.responses import JSONResponse

    from idem_middleware import MemoryStore
    from tests.apps.clients import client, one_route_app

    async def handler(request: Request) -> JSONResponse:
        return JSONResponse({"path": request.url.path})

    app = one_route_app("/first/{n}", handler, store=MemoryStore())
    async with client(app) as c:
        assert (await c.post("/first/1")).status_code == 400  # guarded: no key
        app.router.routes = [Route("/second/{n}", handler, methods=["POST"])]
        answer = await c.post("/second/1")
        assert answer.status_code == 400, answer.text
        assert answer.json()["type"].endswith("missing-key")
        keyed = await c.post("/second/2", headers={"idempotency-key": "k-2"})
        assert keyed.json() == {"path": "/second/2"}


def test_methods_a_client_makes_up_are_not_kept_without_bound() -> None:
    """Any token is a method to a server (h11 takes 4,000 characters of one): an included
    router's routes filed per method made one memo entry per method sent, for good."""
    fastapi = pytest.importorskip("fastapi")
    app = fastapi.FastAPI()
    router = fastapi.APIRouter()
    router.post("/things/{id}")(endpoint)
    app.include_router(router, prefix="/api")
    memo = Memo()
    for n in range(2_000):
        match_route(app.router.routes, http("/api/things/1", method=f"X{n}"), "", Trace(memo))
    (entry,) = memo.included.values()
    assert 0 < len(entry[3]) <= 32
    match = match_route(app.router.routes, http("/api/things/1"), "", Trace(memo))  # still found
    assert isinstance(match, RouteMatch)
    assert match.template == "/api/things/{id}"
    assert "POST" in entry[3]  # (HTTP's own methods are kept filed, whatever came first)
