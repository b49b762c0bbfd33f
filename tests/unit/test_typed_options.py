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


_PUBLIC = (
    "idem_middleware",
    "idem_middleware.downstream",
    "idem_middleware.fastapi",
    "idem_middleware.jobs",
    "idem_middleware.keysource",
    "idem_middleware.pytest_plugin",
    "idem_middleware.sqla",
    "idem_middleware.store",
    "idem_middleware.store.memory",
    "idem_middleware.store.postgres",
)


def _hinted(module_name: str) -> list[tuple[str, object]]:
    import importlib

    module = importlib.import_module(module_name)
    found: list[tuple[str, object]] = []
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value):
            found.append((name, value))
            for attribute, member in vars(value).items():
                if inspect.isfunction(member) and (
                    attribute == "__init__" or not attribute.startswith("_")
                ):
                    found.append((f"{name}.{attribute}", member))
        elif inspect.isfunction(value):
            found.append((name, value))
    return found


def test_every_public_class_and_function_has_hints_that_resolve() -> None:
    """Every class and function a public module exports, and their public methods, answer
    `typing.get_type_hints` (pydantic, FastAPI and documentation tools call it): a policy's key
    source, a replay hook, the store's pool and the generated `__init__` of the frozen records
    named types their modules never bound at run time."""
    failures = []
    for module_name in _PUBLIC:
        for name, value in _hinted(module_name):
            try:
                typing.get_type_hints(value)
            except Exception as error:
                failures.append(f"{module_name}.{name}: {type(error).__name__}: {error}")
    assert failures == []
