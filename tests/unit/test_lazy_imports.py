"""The package imports its parts when first used: the pytest plugin, which loads in every pytest
run of a project with the package installed, costs that run no middleware, store or framework."""

from __future__ import annotations

import importlib
import subprocess
import sys

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
