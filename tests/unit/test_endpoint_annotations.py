"""`@idempotent` endpoints in a module with `from __future__ import annotations` (this one), on
every FastAPI the package declares: FastAPI before 0.123.5 read the guarding wrapper's
signature (the endpoint's, through `__wrapped__`) and resolved its strings in the wrapper's
module, not the endpoint's. A body model and every dependency became a required query
parameter: each guarded request a 422, and `app.openapi()` raised. Found by probing at the
declared floor (fastapi 0.110.1). The wrapper now carries the endpoint's signature resolved."""

from __future__ import annotations

import inspect
import types
from typing import Annotated, Any

from fastapi import Depends
from fastapi.dependencies.utils import get_typed_annotation
from pydantic import BaseModel

from idem_middleware import idempotent


class Order(BaseModel):
    item: str


def tenant_of() -> str:
    return "tenant-a"


Tenant = Annotated[str, Depends(tenant_of)]


@idempotent()
async def create(order: Order, tenant: Tenant, later: Undefined) -> Order:  # type: ignore[name-defined]  # noqa: F821
    return order


def _as_fastapi_before_0_123_5(call: Any) -> dict[str, Any]:
    """What FastAPI 0.110 to 0.123.4 made of an endpoint's parameters (`get_typed_signature`):
    the signature through `__wrapped__`, its strings resolved in `call`'s own module."""
    signature = inspect.signature(call)
    names = getattr(call, "__globals__", {})
    typed = {
        p.name: get_typed_annotation(p.annotation, names) for p in signature.parameters.values()
    }
    typed["return"] = signature.return_annotation
    return typed


def test_the_guarded_endpoints_annotations_are_its_modules() -> None:
    assert create.__globals__ is not globals()  # (the wrapper's module: the old resolution's)
    typed = _as_fastapi_before_0_123_5(create)
    assert typed["order"] is Order
    assert typed["tenant"] == Tenant
    assert typed["return"] is Order
    # A name the module does not define (yet) is left as it was, for the framework to judge.
    assert "Undefined" in repr(typed["later"])


def test_through_another_modules_decorator_the_strings_are_the_endpoints() -> None:
    """Found by review: resolved in the module of a `functools.wraps` decorator between (whose
    own `Order` then replaced this one's), not the endpoint's own."""
    other = types.ModuleType("other_decorators")
    exec(  # a decorator module of the app's, which has an `Order` of its own
        "import functools\n"
        "class Order:\n"
        "    pass\n"
        "def logged(f):\n"
        "    @functools.wraps(f)\n"
        "    async def inner(*a, **k):\n"
        "        return await f(*a, **k)\n"
        "    return inner\n",
        other.__dict__,
    )

    async def place(order: Order, tenant: Tenant) -> Order:
        return order

    guarded = idempotent()(other.logged(place))
    parameters = inspect.signature(guarded).parameters  # (what FastAPI reads now)
    assert parameters["order"].annotation is Order
    assert parameters["tenant"].annotation == Tenant
    assert _as_fastapi_before_0_123_5(guarded)["order"] is Order
