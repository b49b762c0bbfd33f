"""What the library's smaller public functions take, checked where they are called (each found
by probing a sweep of the public API with values an application could pass by mistake).

`Happened.json` turned NaN and the infinities into `null`, the body then replayed so for the
record's whole retention (an outbox event and a job's result refuse them); `guarded_operations`
(and `collect_policies`, `collect_reconcilers`) answered nothing at all for what is no app (None,
a factory, a module's name), so a reconcile run built on them reconciled nothing without a word;
`reconcile_unknown`, `get_context`, `derive_downstream_key` and `status_route` took values they
then failed on, or answered wrongly for."""

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


def _plain(context: Any) -> Any:  # pragma: no cover - refused before it could run
    raise AssertionError("never run")


async def _reconciler(context: Any) -> Any:  # pragma: no cover - nothing to reconcile
    raise AssertionError("never run")


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"seconds": 0}, ValueError, "seconds must be positive"),
        ({"seconds": -1}, ValueError, "seconds must be positive"),
        ({"seconds": float("nan")}, ValueError, "seconds must be a finite number"),
        ({"limit": -1}, ValueError, "limit must be a whole number from 0"),
        ({"limit": "5"}, ValueError, "limit must be a whole number from 0"),
        ({"limit": True}, ValueError, "limit must be a whole number from 0"),
        ({"reconcilers": [_reconciler]}, TypeError, "reconcilers maps operation names"),
        ({"reconcilers": {"POST /x": _plain}}, TypeError, "is not an async function"),
        ({"reconcilers": {"POST /x": 5}}, TypeError, "is not an async function"),
    ],
)
async def test_reconcile_unknown_refuses_what_would_do_nothing_or_fail_every_pass(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Found by probing: `seconds` of 0 or less failed every reconciler that awaits anything,
    NaN bounded none (a hanging one ran on); `limit=-1` did nothing, `"5"` failed inside; a
    plain function among the reconcilers ran, then failed, at every pass."""
    from idem_middleware import MemoryStore
    from idem_middleware.reconcile_batch import reconcile_unknown

    given = {"reconcilers": {"POST /x": _reconciler}, **arguments}
    with pytest.raises(error, match=message):
        await reconcile_unknown(MemoryStore(), **given)
    report = await reconcile_unknown(MemoryStore(), {"POST /x": _reconciler}, limit=0)
    assert report.verdicts == {}


def test_the_small_helpers_refuse_what_they_cannot_take() -> None:
    """Found by probing: `get_context(None)` was an AttributeError from inside;
    `derive_downstream_key` derived another key for `epoch=True` than for 1 and the same for
    "1", and an int key failed inside; `status_route(path="")` was Starlette's bare assert."""
    from idem_middleware import MemoryStore, get_context
    from idem_middleware.context import derive_downstream_key
    from idem_middleware.errors import ConfigurationError
    from idem_middleware.status import status_route

    for given in (None, "scope"):
        with pytest.raises(TypeError, match="get_context takes a request or its scope"):
            get_context(given)
    with pytest.raises(LookupError):
        get_context({"type": "http"})  # (a scope no claim runs under: as before)
    for epoch in (True, "1", 1.0):
        with pytest.raises(TypeError, match="epoch is an int or None"):
            derive_downstream_key("t", "POST /x", "k", epoch)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="as str"):
        derive_downstream_key("t", "POST /x", 7)  # type: ignore[arg-type]
    assert derive_downstream_key("t", "POST /x", "k", 1) != derive_downstream_key(
        "t", "POST /x", "k"
    )
    for path in ("", "status"):
        with pytest.raises(ConfigurationError, match="path starts with '/'"):
            status_route(MemoryStore(), path=path)
