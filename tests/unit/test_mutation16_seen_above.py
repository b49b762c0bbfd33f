"""Mutants of startup.py's `_seen_above` (the app's own routes found among those the router above
lists, by endpoint and path ending) killed: a route of a custom class whose path does not start
with a slash is still seen from above, and named so (it ends the path above it as `_seen_as`
says); kept by its ending alone, it was left out of the app's routes named from above."""

from __future__ import annotations

from typing import Any

from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, Host, Match, Mount, Route, Router
from starlette.types import Receive, Scope, Send

import idem_middleware.startup as startup
from idem_middleware.routing import Found, walk


async def pay(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


class Loose(BaseRoute):
    """A route class of the app's own, whose path is written without the leading slash."""

    def __init__(self, path: str, endpoint: Any) -> None:
        self.path, self.endpoint, self.methods = path, endpoint, {"POST"}

    def matches(self, scope: Scope) -> tuple[Match, Scope]:  # pragma: no cover - never asked
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:  # pragma: no cover
        raise NotImplementedError

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:  # pragma: no cover
        raise NotImplementedError


def test_a_route_whose_path_has_no_leading_slash_is_seen_from_above() -> None:
    sub = Router([Route("/x", pay, methods=["POST"]), Loose("pay", pay)])
    above = [Mount("/api", app=sub)]
    own = [item for item in walk(sub.routes) if isinstance(item, Found)]
    assert [item.template for item in own] == ["/x", "pay"]
    pairs = [(item.template, mine.template) for item, mine in startup._seen_above(above, own)]
    assert pairs == [("/api/x", "/x"), ("/apipay", "pay")]
    named = startup._named_above(sub.routes, {"router": Router(above)}, sub)
    assert [getattr(item, "template", None) for item in named] == ["/api/x", "/apipay"]


def test_a_route_of_the_same_endpoint_under_another_host_is_not_seen_as_the_apps() -> None:
    """The app's own `api.example/pay` ends `other.example/pay`'s path too: the host tells them
    apart (`_seen_as`), not the ending the routes are kept by."""
    sub = Router([Host("api.example", app=Router([Route("/pay", pay, methods=["POST"])]))])
    other = Host("other.example", app=Router([Route("/pay", pay, methods=["POST"])]))
    above = [other, Mount("/v1", app=sub)]
    own = [item for item in walk(sub.routes) if isinstance(item, Found)]
    pairs = [(item.template, mine.template) for item, mine in startup._seen_above(above, own)]
    assert pairs == [("api.example/v1/pay", "api.example/pay")]
