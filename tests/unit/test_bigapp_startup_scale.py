"""The startup check of an app with thousands of routes: each step is linear in the routes,
however many of them share one endpoint. Two steps compared every route with every other:
finding the middleware declared on the way to each guarded route (`middleware_inside`: 20,000
routes took seven seconds of the first request), and naming a mounted sub-app's routes as the
router above lists them (`_seen_above`: 8,000 routes of one endpoint, forty seconds)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.responses import PlainTextResponse
from starlette.routing import Host, Mount, Route, Router

import idem_middleware.startup as startup
from idem_middleware.middleware_order import middleware_inside
from idem_middleware.routing import Found, walk

ROUTES = 2000


async def shared(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ran")


def endpoint(one: bool) -> Any:
    if one:
        return shared

    async def own(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ran")

    return own


class Scanned(list[Found]):
    """The guarded routes, counting how many times they are scanned."""

    scans = 0

    def __iter__(self) -> Any:
        self.scans += 1
        return super().__iter__()


class Counted(str):
    """A template counting how many times another is compared with its end."""

    calls: ClassVar[list[int]] = [0]

    def endswith(self, *args: Any) -> bool:
        self.calls[0] += 1
        return super().endswith(*args)


def big_app(one: bool) -> FastAPI:
    app = FastAPI(openapi_url=None)
    for i in range(ROUTES):
        app.add_api_route(f"/{{tenant}}/r{i}/{{id:int}}", endpoint(one), methods=["POST"])
    zipped = [Middleware(GZipMiddleware)]
    app.router.routes.append(
        Mount("/zip", routes=[Route("/pay", endpoint(one), methods=["POST"])], middleware=zipped)
    )
    app.router.routes.append(Host("api.test", app=Router([Route("/h", shared, methods=["POST"])])))
    return app


@pytest.mark.parametrize("one", [False, True], ids=["own endpoints", "one endpoint"])
def test_the_guarded_routes_are_not_compared_with_every_route(one: bool) -> None:
    app = big_app(one)
    Counted.calls[0] = 0
    found = Scanned(
        Found(Counted(item.template), item.methods, item.endpoint, item.route)
        for item in walk(app.router.routes)
        if isinstance(item, Found)
    )
    inside = list(middleware_inside(app.router.routes, found))
    assert inside.count(None) == len(found) == ROUTES + 2  # every guarded route reached
    assert (GZipMiddleware, "/zip") in inside  # (and what is on the way to one)
    assert found.scans == 1  # (not once per route)
    assert Counted.calls[0] <= len(found)  # (for the one route under the Host alone)


@pytest.mark.parametrize("one", [False, True], ids=["own endpoints", "one endpoint"])
def test_a_mounted_apps_routes_are_named_from_above_in_linear_time(
    one: bool, monkeypatch: Any
) -> None:
    sub = Router([Route(f"/r{i}/{{id}}", endpoint(one), methods=["POST"]) for i in range(ROUTES)])
    above = [Mount("/api", app=sub), Mount("/v2", app=sub)]
    own = [item for item in walk(sub.routes) if isinstance(item, Found)]
    compared = [0]
    seen_as = startup._seen_as

    def counting(above: str, mine: str) -> bool:
        compared[0] += 1
        return seen_as(above, mine)

    monkeypatch.setattr(startup, "_seen_as", counting)
    pairs = [(item.template, mine.template) for item, mine in startup._seen_above(above, own)]
    expected = [
        (f"{prefix}/r{i}/{{id}}", f"/r{i}/{{id}}")
        for prefix in ("/api", "/v2")
        for i in range(ROUTES)
    ]
    assert pairs == expected
    assert compared[0] <= 2 * ROUTES
