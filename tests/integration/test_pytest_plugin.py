"""The pytest plugin (idem_middleware.pytest_plugin), run through pytester in a subprocess."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def docs_example() -> str:
    text = (ROOT / "docs" / "testing.md").read_text()
    match = re.search(r"## Example\n.*?```python\n(.*?)```", text, re.DOTALL)
    assert match, "no example in docs/testing.md"
    return match.group(1)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # Only the plugins named here: an installed entry point must not load it a second time.
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    return pytester.runpytest_subprocess(
        "-p", "idem_middleware.pytest_plugin", "-p", "pytest_asyncio.plugin", *args
    )


@pytest.fixture
def inner_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> Path:
    return use_this_server(pytester, monkeypatch, pg_dsn)


def use_this_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_dsn: str
) -> Path:
    """The inner run uses this run's server (no second one) and its own temporary directory."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("IDEM_TEST_DSN", pg_dsn)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def test_the_docs_example_passes(pytester: pytest.Pytester, inner_env: Path) -> None:
    pytester.makepyfile(test_example=docs_example())
    result = run(pytester)
    result.assert_outcomes(passed=2)


def test_replay_helper_fails_when_the_second_response_is_not_a_replay(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    pytester.makepyfile(
        test_unguarded="""
import httpx, pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from idem_middleware import IdempotencyMiddleware, not_idempotent

@not_idempotent
async def handler(request):
    return JSONResponse({"ok": True})

@pytest.mark.asyncio
async def test_unguarded(idem_store, idem_replay):
    app = Starlette(routes=[Route("/x", handler, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=idem_store, tenant_resolver=lambda s: "t")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        await idem_replay(http, "POST", "/x", json={})
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the second response is not a replay*"])


def test_a_run_that_uses_no_fixture_starts_no_database(
    pytester: pytest.Pytester, inner_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IDEM_TEST_DSN")
    pytester.makepyfile(test_plain="def test_plain():\n    assert 1 + 1 == 2\n")
    result = run(pytester)
    result.assert_outcomes(passed=1)
    assert not list(inner_env.glob("idem-pytest-pg-*"))


def test_the_plugin_is_a_pytest11_entry_point() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {
        "idem_middleware": "idem_middleware.pytest_plugin"
    }
