"""body_limits.py, pinned against a hand-made mutant (mutation17): a mounted app's limits are
found behind the middleware wrapping it (`Mount("/v1", app=SomeMiddleware(sub))`), not only
when the mount dispatches to the app itself: missed, a guarded body over the mounted app's own
limit is claimed and then refused by that app, not the middleware's 413 before any claim."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware.body_limits import mounted_limit


class Passing:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)  # pragma: no cover


async def _pay(request: Request) -> Response:
    return Response(b"", status_code=201)  # pragma: no cover


def test_a_mounted_apps_limit_is_found_behind_the_middleware_wrapping_it() -> None:
    try:
        sub = Starlette(routes=[Route("/pay", _pay, methods=["POST"])], max_body_size=100)
    except TypeError:  # pragma: no cover - a Starlette before 1.10
        pytest.skip("no app-level max_body_size")
    assert mounted_limit(sub) == 100
    assert mounted_limit(Passing(sub)) == 100
    assert mounted_limit(Passing(Passing(Passing(sub)))) == 100
