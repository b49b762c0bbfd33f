"""The typed dictionaries of options (idem_middleware.options) name exactly the options the
policy and the middleware take: a new option missing from them would be refused by a type
checker in `@idempotent(...)` or `install(...)` although it works."""

from __future__ import annotations

import dataclasses
import inspect
import typing

from idem_middleware import IdempotencyMiddleware, Policy
from idem_middleware.options import MiddlewareOptions, PolicyOptions


def test_policy_options_name_every_field_of_a_policy() -> None:
    assert set(PolicyOptions.__annotations__) == {f.name for f in dataclasses.fields(Policy)}


def test_middleware_options_name_every_keyword_of_the_middleware_but_its_store() -> None:
    parameters = inspect.signature(IdempotencyMiddleware.__init__).parameters
    keywords = {n for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(MiddlewareOptions.__annotations__) == keywords - {"store"}


def test_the_public_functions_hints_resolve_at_run_time() -> None:
    """Tools that read hints at run time (FastAPI, documentation) resolve them: names imported
    for type checkers alone raised NameError in `typing.get_type_hints`."""
    from idem_middleware import get_context, idempotent
    from idem_middleware.fastapi import install

    for function in (get_context, idempotent, install, Policy.replace):
        assert "return" in typing.get_type_hints(function), function
