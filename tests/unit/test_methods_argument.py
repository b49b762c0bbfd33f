"""`methods=` as written: lower-case names guard their methods (`methods=["post"]` guarded
nothing, every POST ran with no key), and a safe method among them fails loudly at setup
(it is never guarded: taken silently, the app believed its GETs were)."""

from __future__ import annotations

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import ConfigurationError, IdempotencyMiddleware, MemoryStore
from tests.apps import client, one_route_app


async def pay(request: Request) -> Response:
    return JSONResponse({}, status_code=201)


async def test_lower_case_methods_guard_their_methods() -> None:
    app = one_route_app("/pay", pay, store=MemoryStore(), methods=["post"])
    async with client(app) as c:
        unkeyed = await c.post("/pay", json={})
    assert unkeyed.status_code == 400, unkeyed.text  # guarded: no key, refused


@pytest.mark.parametrize("methods", [["POST", "GET"], ["head"]])
def test_a_safe_method_among_methods_is_refused(methods: list[str]) -> None:
    with pytest.raises(ConfigurationError, match="safe methods are never guarded"):
        IdempotencyMiddleware(lambda s, r, se: None, store=MemoryStore(), methods=methods)


def test_a_policy_keyed_by_a_safe_method_is_refused() -> None:
    from idem_middleware import Policy

    with pytest.raises(ConfigurationError, match="GET is never guarded"):
        IdempotencyMiddleware(
            lambda s, r, se: None, store=MemoryStore(), policies={"GET /pay": Policy()}
        )
