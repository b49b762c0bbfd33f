"""Routes the router dispatches to in ways the route candidates' trie must not hide: a route whose
regex was set by hand (it may take paths its `path` does not start with), and an included
FastAPI route of a class with its own `matches`. Each case compares the route the middleware
names with the endpoint the framework really runs."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, Host, Match, Mount, Route, Router, compile_path

from idem_middleware import IdempotencyMiddleware, MemoryStore, not_idempotent
from idem_middleware.policy import RouteMatch
from idem_middleware.routing import match_route
from tests.apps import BearerBackend, client, key


def http(path: str, method: str = "POST", **extra: Any) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "headers": [(b"host", b"test")],
        "query_string": b"",
        **extra,
    }


def endpoint_named(name: str, ran: list[str]) -> Any:
    async def handler(request: Request) -> PlainTextResponse:
        ran.append(name)
        return PlainTextResponse(name)

    handler.__name__ = name
    return handler


def ran_by(app: Any, path: str, ran: list[str]) -> str | None:
    """The endpoint the app runs for a POST to `path` (None: a 404, 405 or redirect)."""
    ran.clear()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    asyncio.run(app(http(path, app=app), receive, send))
    return ran[0] if ran else None


def named(routes: list[BaseRoute], path: str) -> str | None:
    match = match_route(routes, http(path))
    return match.endpoint.__name__ if isinstance(match, RouteMatch) else None


def hand_set(route: Route | Mount, extra: str, convertors: dict[str, Any]) -> Any:
    """`route` with its regex set by hand to also take what `extra` (a regex) takes."""
    route.path_regex = re.compile(route.path_regex.pattern + "|" + extra)
    route.param_convertors = {**route.param_convertors, **convertors}
    return route


def hand_set_tables(ran: list[str]) -> list[tuple[list[BaseRoute], str, str]]:
    """Routes (other routes first), a path, and the endpoint Starlette runs for it."""
    str_convertor = compile_path("/{x}")[2]["x"]
    return [
        (  # a second path for the same endpoint, by alternation
            [
                Route("/other/{x}", endpoint_named("other", ran), methods=["POST"]),
                hand_set(
                    Route("/accounts/{id}", endpoint_named("alt", ran), methods=["POST"]),
                    r"^/legacy/(?P<lid>[^/]+)$",
                    {"lid": str_convertor},
                ),
            ],
            "/legacy/7",
            "alt",
        ),
        (  # case-blind through an inline flag inside the pattern
            [
                Route("/Pay/{x}", endpoint_named("other", ran), methods=["GET"]),
                hand_set(
                    Route("/pay/{x}", endpoint_named("blind", ran), methods=["POST"]),
                    r"^(?i:/PAY)/(?P<y>[^/]+)$",
                    {"y": str_convertor},
                ),
            ],
            "/PAY/1",
            "blind",
        ),
    ]


@pytest.mark.parametrize("case", range(2))
def test_a_route_whose_regex_was_set_by_hand_is_asked_for_the_paths_it_takes(case: int) -> None:
    """Its `path` starts `/accounts`, its regex takes `/legacy/7` too: Starlette runs it for
    `/legacy/7`, so the middleware must ask it there (it was filed under `accounts` only, and
    the request passed unguarded)."""
    ran: list[str] = []
    routes, path, expected = hand_set_tables(ran)[case]
    app = Starlette(routes=routes)
    assert ran_by(app, path, ran) == expected
    assert named(app.router.routes, path) == expected


SEGMENTS = st.sampled_from(["a", "b", "{x}", ""])
LITERALS = st.lists(st.sampled_from(["a", "b", "7", ""]), min_size=1, max_size=3)


def _path(parts: list[str]) -> str:
    count = iter(range(10))
    return "/" + "/".join(part.replace("{x}", f"{{p{next(count)}}}") for part in parts)


@st.composite
def hand_set_routes(draw: st.DrawFn) -> tuple[list[BaseRoute], list[str]]:
    """Routes and mounts on paths of a few segments; some routes' regexes were set by hand, to
    take a literal path as well (alternation) or another path instead; each endpoint records
    that Starlette ran it."""
    ran: list[str] = []
    routes: list[BaseRoute] = []
    for number in range(draw(st.integers(1, 6))):
        path = _path(draw(st.lists(SEGMENTS, min_size=1, max_size=3)))
        handler = endpoint_named(f"{path} #{number}", ran)
        if draw(st.booleans()) and path.rstrip("/"):
            mounted = Router([Route("/{rest:path}", handler, methods=["POST"])])
            routes.append(Mount(path, app=mounted))
            continue
        route = Route(path, handler, methods=["POST"])
        how = draw(st.sampled_from(["as made", "also", "instead"]))
        other = _path(draw(st.lists(st.sampled_from(["a", "b", "7", "{x}", ""]), max_size=3)))
        if how == "also":
            hand_set(route, compile_path("/" + "/".join(draw(LITERALS)))[0].pattern, {})
        elif how == "instead":
            route.path_regex, _, route.param_convertors = compile_path(other)
        routes.append(route)
    return routes, ran


PATHS = st.tuples(
    st.lists(st.sampled_from(["a", "b", "7", ""]), max_size=4),
    st.sampled_from(["", "\n"]),  # (a final newline: `$` matches before it)
).map(lambda parts: "/" + "/".join(parts[0]) + parts[1])


@settings(max_examples=300, deadline=None)
@given(built=hand_set_routes(), path=PATHS)
def test_the_route_named_is_the_first_the_router_matches_whatever_the_regexes(
    built: tuple[list[BaseRoute], list[str]], path: str
) -> None:
    routes, ran = built
    first = next((r for r in routes if r.matches(http(path))[0] is Match.FULL), None)
    app = Starlette(routes=routes)
    ran_name = ran_by(app, path, ran)
    if first is None or ran_name is None:
        assert named(routes, path) is None, (path, ran_name)
    else:
        assert named(routes, path) == ran_name, path


# -- an included FastAPI route of a class with its own `matches` ---------------------------------


def versioned_app() -> tuple[Any, list[str]]:
    """`POST /api/pay/{x}`, twice: a version 2 route (its class matches only with
    `x-version: 2`, and it is `@not_idempotent`) before the guarded version 1, each in its own
    included router, the middleware inside the app."""
    fastapi = pytest.importorskip("fastapi")
    from fastapi.routing import APIRoute

    class VersionTwo(APIRoute):
        def matches(self, scope: Any) -> Any:
            match, child = super().matches(scope)
            if match is Match.FULL and (b"x-version", b"2") not in scope["headers"]:
                return Match.NONE, {}
            return match, child

    ran: list[str] = []
    two = fastapi.APIRouter(route_class=VersionTwo)
    one = fastapi.APIRouter()

    @two.post("/pay/{x}")
    @not_idempotent
    async def version_two(request: Request) -> dict[str, str]:
        ran.append("two")
        return {"version": "2"}

    @one.post("/pay/{x}")
    async def version_one(request: Request) -> dict[str, str]:
        ran.append("one")
        return {"version": "1"}

    app = fastapi.FastAPI()
    app.include_router(two, prefix="/api")
    app.include_router(one, prefix="/api")
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app, ran


async def test_an_included_route_of_its_own_matches_is_asked_as_fastapi_asks_it() -> None:
    """Without the header FastAPI runs version 1; the middleware named version 2 (its path
    regex matches), found it `@not_idempotent` and passed the request on unguarded."""
    app, ran = versioned_app()
    assert named(app.router.routes, "/api/pay/1") == "version_one"
    versioned = http("/api/pay/1", headers=[(b"host", b"test"), (b"x-version", b"2")])
    match = match_route(app.router.routes, versioned)
    assert isinstance(match, RouteMatch)
    assert match.endpoint.__name__ == "version_two"
    async with client(app) as c:
        unkeyed = await c.post("/api/pay/2", json={})
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        assert ran == []
        assert (await c.post("/api/pay/2", json={}, headers=key("k2"))).status_code == 200
        assert (await c.post("/api/pay/2", json={}, headers={"x-version": "2"})).status_code == 200
    assert ran == ["one", "two"]


async def test_a_path_resolved_past_a_route_of_its_own_matches_is_not_kept() -> None:
    """The route cache keys on the method, path and Host, not on the header the route's class
    reads: the path resolved with the header (twice: kept, were it kept), then without it, must
    be guarded (a key is required) as FastAPI runs version 1."""
    app, ran = versioned_app()
    async with client(app) as c:
        for _ in range(2):  # (twice: the route cache keeps a path from its second request)
            two = await c.post("/api/pay/1", json={}, headers={"x-version": "2"})
            assert two.status_code == 200, two.text
        assert ran == ["two", "two"]
        unkeyed = await c.post("/api/pay/1", json={})
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        keyed = await c.post("/api/pay/1", json={}, headers=key("k1"))
        assert keyed.status_code == 200, keyed.text
        assert ran == ["two", "two", "one"]
        again = await c.post("/api/pay/1", json={}, headers=key("k1"))
        assert again.headers.get("idempotent-replayed") == "true"
        assert ran == ["two", "two", "one"]


# -- routes changed at run time, each change a length the route lists show ----------------------


def test_routes_added_and_removed_at_run_time_are_named_as_fastapi_runs_them() -> None:
    """After each change (a route before the others, a router included after the first
    requests, a route added to an included router, one appended to it behind FastAPI's back,
    a route removed), the middleware names what FastAPI runs, for paths asked before and new."""
    fastapi = pytest.importorskip("fastapi")
    from fastapi.routing import APIRoute

    ran: list[str] = []
    app = fastapi.FastAPI()
    router = fastapi.APIRouter()
    router.post("/a/{x}")(endpoint_named("a", ran))
    app.include_router(router, prefix="/p")
    paths = ["/p/a/1", "/p/b/1", "/p/c/1"]

    def agree(step: str) -> None:
        for number, path in enumerate([*paths, *(p[:-1] + step for p in paths)]):
            assert named(app.router.routes, path) == ran_by(app, path, ran), (step, number, path)

    agree("0")
    app.router.routes.insert(0, APIRoute("/p/a/{x}", endpoint_named("top", ran), methods=["POST"]))
    agree("1")
    late = fastapi.APIRouter()
    late.post("/b/{x}")(endpoint_named("late-b", ran))
    app.include_router(late, prefix="/p")
    agree("2")
    router.post("/c/{x}")(endpoint_named("c", ran))
    agree("3")
    router.routes.append(APIRoute("/b/{x}", endpoint_named("unseen", ran), methods=["POST"]))
    agree("4")  # (FastAPI keeps its included routes by a version `append` does not bump)
    del app.router.routes[0]
    agree("5")


# -- a path that ends in a newline -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/pay", "/v1/refunds", "/v1/accounts/7/transfers"])
async def test_a_path_ending_in_an_encoded_newline_is_guarded_as_the_route_it_reaches(
    path: str,
) -> None:
    """Found by probing: `POST /pay%0A` (the server decodes it to `/pay\n`) reaches `/pay`,
    since Starlette's regex ends in `$`, which matches before a final newline; the route
    candidates' trie looked for a segment "pay\n", found none, and the handler ran with no key,
    and again for every repeat of one. At the top level, in an included router, and in a Host's."""
    fastapi = pytest.importorskip("fastapi")
    ran: list[str] = []
    app = fastapi.FastAPI()
    router = fastapi.APIRouter()

    @app.post("/pay")
    async def pay() -> dict[str, int]:
        ran.append("pay")
        return {"n": len(ran)}

    @router.post("/refunds")
    async def refund() -> dict[str, int]:
        ran.append("refund")
        return {"n": len(ran)}

    @router.post("/accounts/{account:int}/transfers")
    async def transfer(account: int) -> dict[str, int]:
        ran.append("transfer")
        return {"n": len(ran)}

    app.include_router(router, prefix="/v1")
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    async with client(app) as c:
        for target in (path, path + "%0A"):
            unkeyed = await c.post(target, json={})
            assert unkeyed.status_code == 400, (target, unkeyed.text)  # guarded: no key
            first = await c.post(target, json={}, headers=key("k" + target))
            again = await c.post(target, json={}, headers=key("k" + target))
            assert first.status_code == again.status_code == 200, (target, first.text)
            assert again.headers.get("idempotent-replayed") == "true", target
        assert len(ran) == 2, ran  # once per key, none unkeyed


# -- a route list replaced by another --------------------------------------------------------------


@pytest.mark.parametrize("where", ["app", "mount", "host"])
async def test_a_route_list_replaced_by_another_is_seen_by_paths_asked_before(where: str) -> None:
    """Found by probing: `app.router.routes = [*app.router.routes, Route("/pay", ...)]` after
    `POST /pay` was a 404. The cached resolution ("no route: unguarded") held while the old list,
    which nothing changes any more, kept its length: the new route ran with no key, and again
    for each repeat of one. The same for a Mount's and a Host's router."""
    ran: list[str] = []
    counted = endpoint_named("pay", ran)
    other = endpoint_named("other", [])
    inner = Router(routes=[Route("/other", other, methods=["POST"])])
    if where == "app":
        routes: list[BaseRoute] = [Route("/other", other, methods=["POST"])]
        holder, path = None, "/pay"
    elif where == "mount":
        routes = [Mount("/v1", app=inner)]
        holder, path = inner, "/v1/pay"
    else:
        routes = [Host("test", app=inner)]
        holder, path = inner, "/pay"
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    router = app.router if holder is None else holder
    async with client(app) as c:
        for _ in range(2):  # (twice: the route cache keeps a path from its second request)
            assert (await c.post(path, json={})).status_code == 404
        router.routes = [*router.routes, Route("/pay", counted, methods=["POST"])]
        unkeyed = await c.post(path, json={})
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        for _ in range(2):
            assert (await c.post(path, json={}, headers=key("k"))).status_code == 200
    assert ran == ["pay"]


async def test_a_mounted_route_list_replaced_by_an_equal_one_is_seen() -> None:
    """Starlette's routes compare by path, endpoint and methods: a list replaced by an equal one
    whose route now has a body limit of its own was taken for the same list, and the cached
    resolution (no limit) kept answering; the very list is compared now."""
    from starlette.middleware.body_limit import RequestBodyLimitMiddleware

    ran: list[str] = []
    counted = endpoint_named("pay", ran)

    def built(limit: int | None) -> Route:
        limited = [Middleware(RequestBodyLimitMiddleware, max_body_size=limit)] if limit else None
        return Route("/pay", counted, methods=["POST"], middleware=limited)

    sub = Starlette(routes=[built(None)])
    app = Starlette(
        routes=[Mount("/sub", app=sub)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    body = {"content": b"y" * 100, "headers": {"content-type": "application/octet-stream"}}
    async with client(app) as c:
        for _ in range(2):  # (twice: the route cache keeps a path from its second request)
            first = await c.post("/sub/pay", content=b"x", headers=key("a"))
            assert first.status_code == 200, first.text
        sub.router.routes = [built(10)]
        answer = await c.post(
            "/sub/pay", content=body["content"], headers={**body["headers"], **key("b")}
        )
    assert answer.status_code == 413, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert ran == ["pay"]


@pytest.mark.parametrize("where", ["app", "mount"])
async def test_a_default_app_set_after_requests_is_seen_by_paths_asked_before(where: str) -> None:
    """Found in review: `app.router.default = legacy` after `POST /refund` was a 404. The
    cached resolution ("no route: unguarded") held while the route lists kept their lengths:
    the default app's route ran with no key, and again for each repeat of one. A resolution
    that fell through a router keeps the router's default then."""
    ran: list[str] = []
    legacy = Starlette(routes=[Route("/refund", endpoint_named("refund", ran), methods=["POST"])])
    inner = Router(routes=[Route("/other", endpoint_named("other", []), methods=["POST"])])
    routes: list[BaseRoute] = [Mount("/v1", app=inner)] if where == "mount" else []
    app = Starlette(
        routes=[*routes, Route("/other", endpoint_named("other", []), methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    path = "/v1/refund" if where == "mount" else "/refund"
    async with client(app) as c:
        for _ in range(2):  # (twice: the route cache keeps a path from its second request)
            assert (await c.post(path, json={})).status_code == 404
        (inner if where == "mount" else app.router).default = legacy
        unkeyed = await c.post(path, json={})
        assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused
        for _ in range(2):
            assert (await c.post(path, json={}, headers=key("k"))).status_code == 200
    assert ran == ["refund"]


def test_fastapis_low_priority_routes_come_before_a_default_app(tmp_path: Any) -> None:
    """Found in review: FastAPI's router tries its low-priority routes (`frontend`) before its
    default app; the middleware took a request they answer (404) for the default app's, and
    refused it without a key, where FastAPI never runs the default app."""
    fastapi = pytest.importorskip("fastapi")
    router = fastapi.APIRouter()
    if not hasattr(router, "frontend"):
        pytest.skip("this FastAPI has no low-priority routes")
    (tmp_path / "index.html").write_text("<p>app</p>")
    router.frontend("/", directory=str(tmp_path))
    app = fastapi.FastAPI()
    app.include_router(router)
    ran: list[str] = []
    app.router.default = Starlette(
        routes=[Route("/refund", endpoint_named("refund", ran), methods=["POST"])]
    )
    # (As FastAPI serves it: its frontend's 404, never the default app's route.)
    assert match_route(app.router.routes, http("/refund"), router=app.router) is None
