"""What a reconciler's answers and the operators' listings take, checked where they are made.

Found by probing: `Happened.json` turned NaN and the infinities into `null`, the body then
replayed so for the record's whole retention (an outbox event and a job's result refuse them);
`guarded_operations` (and `collect_policies`, `collect_reconcilers`) answered nothing at all for
what is no app (None, a factory, a module's name), so a reconcile run built on them
reconciled nothing without a word."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware

from idem_middleware.ops import collect_policies, collect_reconcilers, guarded_operations
from idem_middleware.reconcile import Happened


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_happened_json_refuses_what_json_would_carry_as_null(value: float) -> None:
    with pytest.raises(ValueError, match="NaN or an infinity"):
        Happened.json(200, {"amount": [1, value]})
    assert Happened.json(200, {"amount": None}).body == b'{"amount":null}'  # (a null as sent)


@pytest.mark.parametrize(
    "app",
    [None, Starlette, "main:app", object()],
    ids=["None", "a factory", "a str", "an object"],
)
def test_the_listings_refuse_what_is_no_app(app: Any) -> None:
    for listing in (guarded_operations, collect_policies, collect_reconcilers):
        with pytest.raises(TypeError, match="takes a Starlette or FastAPI app"):
            listing(app)
    assert guarded_operations(Starlette()) == []  # an app without guarded routes: nothing
    assert guarded_operations(GZipMiddleware(Starlette())) == []  # (found behind a wrapper)
