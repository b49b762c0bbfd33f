"""docs/security.md: every answer of the status resource carries `Cache-Control: no-store`. Its
`405 method-not-allowed` (and the token route's, to a `GET`, which a cache may keep: a 405 is
heuristically cacheable) did not."""

from __future__ import annotations

from idem_middleware.status import status_route
from idem_middleware.store import MemoryStore
from idem_middleware.tokens import TokenIssuer, token_route
from tests.apps import build_app, client


async def test_the_library_routes_405_is_not_cached() -> None:
    store = MemoryStore()
    app = build_app(store)
    app.router.routes[:0] = [
        status_route(store, path="/s"),
        token_route(TokenIssuer(store, secret=b"s" * 32)),
    ]
    async with client(app) as c:
        answers = [
            await c.post("/s", params={"operation": "POST /x", "key": "k"}),
            await c.delete("/s"),
            await c.get("/idempotency/tokens"),
        ]
        polled = await c.get("/s", params={"operation": "POST /x", "key": "k"})
    for r in answers:
        assert r.status_code == 405
        assert r.headers["cache-control"] == "no-store"
    assert polled.status_code == 404
    assert polled.headers["cache-control"] == "no-store"
