"""The package imports its parts when first used: the pytest plugin, which loads in every pytest
run of a project with the package installed, costs that run no middleware, store or framework."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import idem_middleware

#: What importing the plugin must not import (each cost a pytest run tens of milliseconds).
_HEAVY = ("asyncpg", "starlette", "fastapi", "idem_middleware.middleware", "idem_middleware.store")


def _loaded_after(statement: str) -> list[str]:
    code = (
        "import sys, pytest\n"
        f"{statement}\n"
        f"print(' '.join(m for m in {_HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.split()


def test_the_plugin_imports_nothing_heavy() -> None:
    assert _loaded_after("import idem_middleware.pytest_plugin") == []


def test_the_package_alone_imports_nothing_heavy() -> None:
    assert _loaded_after("import idem_middleware") == []


def test_a_public_name_loads_its_module() -> None:
    # (the check above would pass on a package that imports nothing at all)
    assert "idem_middleware.middleware" in _loaded_after(
        "from idem_middleware import IdempotencyMiddleware"
    )


def test_every_public_name_is_its_modules_own() -> None:
    sources = idem_middleware._SOURCES
    assert sorted(sources) == sorted(idem_middleware.__all__)
    for name, source in sources.items():
        module = importlib.import_module(source, "idem_middleware")
        assert getattr(idem_middleware, name) is getattr(module, name), name
    assert set(idem_middleware.__all__) <= set(dir(idem_middleware))


def test_star_import_gives_every_public_name() -> None:
    names: dict[str, object] = {}
    exec("from idem_middleware import *", names)
    assert set(idem_middleware.__all__) <= set(names)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Polciy'"):
        _ = idem_middleware.Polciy  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        exec("from idem_middleware import Polciy", {})


def _type_checking_imports() -> dict[str, str]:
    """The names `__init__.py` imports under `if TYPE_CHECKING:`, each with its module."""
    tree = ast.parse(Path(idem_middleware.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
        if node.test.id == "TYPE_CHECKING"
    )
    return {
        alias.name: "." * node.level + (node.module or "")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_type_checkers_see_every_public_name_from_its_module() -> None:
    # (a name missing there is an error in a user's mypy run, not its type)
    assert _type_checking_imports() == idem_middleware._SOURCES


def test_a_misspelt_name_is_a_type_error(tmp_path: Path) -> None:
    # A module-level `__getattr__` seen by mypy types every name it lacks as `Any`: a user's
    # `from idem_middleware import Polciy` passed `mypy --strict` and failed only at run time.
    pytest.importorskip("mypy")
    user = tmp_path / "user_module.py"
    user.write_text("from idem_middleware import Policy, Polciy\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(user),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(idem_middleware.__file__).parent.parent,
    )
    assert 'Module "idem_middleware" has no attribute "Polciy"' in done.stdout, done.stdout
