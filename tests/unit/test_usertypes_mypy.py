"""The public API as a user's type checker sees it: what pyright reads differently from mypy,
checked here on the annotations themselves (`mypy --strict` on a user's code,
tests/typed_usertypes.py, runs with the README's examples: test_readme_examples.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import idem_middleware
from idem_middleware.observe import Observer

ROOT = Path(idem_middleware.__file__).resolve().parent.parent


def test_async_context_managers_return_what_pyright_reads_an_async_def_as() -> None:
    # pyright reads a protocol's `async def __aexit__` (AbstractAsyncContextManager's) as
    # returning `types.CoroutineType`: PgTransaction's plain `def __aexit__` annotated
    # `Coroutine` made PostgresStore no `Store`, and `install(app, store=PostgresStore(...))`,
    # the README's own line, a pyright error in every user's app.
    plain = []
    for path in sorted((ROOT / "idem_middleware").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("__aenter__", "__aexit__"):
                returns = ast.unparse(node.returns) if node.returns else ""
                if not returns.startswith("CoroutineType["):
                    plain.append(f"{path.name}:{node.lineno} {node.name} -> {returns}")
    assert plain == []


def test_an_observer_may_name_its_parameters_as_it_likes() -> None:
    # The middleware passes them positionally; pyright held an observer whose `event` took
    # `(kind, attrs)` to the protocol's names, and refused it.
    for method in (Observer.event, Observer.timed):
        kinds = [p.kind for p in inspect.signature(method).parameters.values()][1:]
        assert kinds == [inspect.Parameter.POSITIONAL_ONLY] * 2, method.__name__
