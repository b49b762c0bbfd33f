"""Pinned: only a 4xx HTTPException from the app's callbacks is answered by the middleware
(refusals.is_refusal). A 3xx one (a resolver that redirects to a login page, say) is no client
error: it goes on to the server's error handling as any other exception does, nothing claimed."""

from __future__ import annotations

import pytest
from starlette.exceptions import HTTPException as StarletteHTTPException

from idem_middleware import Policy
from idem_middleware.refusals import is_refusal
from idem_middleware.store.base import Store
from tests.integration.test_callback_refusals import GOOD, build, client, raising, stored


@pytest.mark.parametrize("status", [300, 303, 307, 399, 500, 503])
def test_a_status_outside_4xx_is_no_refusal(status: int) -> None:
    assert not is_refusal(StarletteHTTPException(status))


@pytest.mark.parametrize("status", [400, 401, 403, 429, 499])
def test_a_4xx_is_a_refusal(status: int) -> None:
    assert is_refusal(StarletteHTTPException(status))


async def test_a_redirect_from_a_key_function_goes_on(store: Store) -> None:
    exc = StarletteHTTPException(307, "log in first", headers={"Location": "/login"})
    app = build(
        store,
        lambda scope: "tenant-a",
        default_policy=Policy(key_source=raising(exc, asynchronous=False)),
    )
    async with client(app, raise_app_exceptions=True) as c:
        with pytest.raises(StarletteHTTPException) as raised:
            await c.post("/orders", headers=GOOD, json={"id": "evt-1"})
    assert raised.value is exc
    assert app.state.calls == 0
    assert await stored(store) == 0
