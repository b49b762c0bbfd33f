"""The README's app (FastAPI with SQLAlchemy) and the apps of docs/fastapi.md and
docs/starlette.md: type-checked with mypy --strict, and run; the README's test of its app and
docs/testing.md's tests: type-checked too, and run through pytester."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.integration.test_pytest_plugin import run, use_this_server

ROOT = Path(__file__).resolve().parents[2]


def example(heading: str, page: str = "README.md") -> str:
    text = (ROOT / page).read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, f"no python block under {heading!r} in {page}"
    return match.group(1)


#: The README's apps, by the heading they are under.
EXAMPLES = {"sqlalchemy": "FastAPI with SQLAlchemy"}
#: Apps on other pages: name -> (page, heading).
PAGE_EXAMPLES = {
    "fastapi": ("docs/fastapi.md", "Minimal FastAPI app"),
    "fastapi_own_auth": (
        "docs/fastapi.md",
        "Adding it to an app with its own authentication and pool",
    ),
    "starlette": ("docs/starlette.md", "Minimal Starlette app"),
}
#: The README's test of its SQLAlchemy app (which it imports as `app`).
README_TEST = "Testing your app"
#: docs/testing.md's tests of a small app: page, heading.
TESTING_EXAMPLE = ("docs/testing.md", "Example")


@pytest.fixture(scope="module")
def example_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("readme")
    files = {}
    sources = {name: ("README.md", heading) for name, heading in EXAMPLES.items()}
    for name, (page, heading) in {**sources, **PAGE_EXAMPLES}.items():
        path = folder / f"readme_{name}.py"
        path.write_text(example(heading, page))
        files[name] = path
    # The README's test and the app it imports, under the names the README gives them.
    (folder / "app.py").write_text(example(EXAMPLES["sqlalchemy"]))
    files["test"] = folder / "test_app.py"
    files["test"].write_text(example(README_TEST))
    files["testing"] = folder / "test_testing_page.py"
    files["testing"].write_text(example(TESTING_EXAMPLE[1], TESTING_EXAMPLE[0]))
    # An adopter's typed code: the options as the docs give them (type-checked, never run).
    files["typed"] = folder / "typed_usage.py"
    files["typed"].write_text((ROOT / "tests" / "typed_usage.py").read_text())
    # And a user's code as their checkers read the public API (test_usertypes_mypy.py).
    files["usertypes"] = folder / "typed_usertypes.py"
    files["usertypes"].write_text((ROOT / "tests" / "typed_usertypes.py").read_text())
    return files


def test_examples_pass_mypy_strict(example_files: dict[str, Path]) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            *map(str, example_files.values()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=example_files["fastapi"].parent,
        # An editable install is invisible to mypy; point it at the package as installed.
        env={**os.environ, "MYPYPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted([*EXAMPLES, *PAGE_EXAMPLES]))
async def test_examples_run_and_replay(
    name: str,
    example_files: dict[str, Path],
    db_dsn: str,
    pool: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, tenant text, item text)"
    )
    await pool.execute("TRUNCATE orders")
    # With a libpq option in the URL, as a hosted database's URL often has: each example reads
    # it as asyncpg does (SQLAlchemy's own reading passed `sslmode` to asyncpg, which refused it).
    with_option = db_dsn + ("&" if "?" in db_dsn else "?") + "sslmode=disable"
    monkeypatch.setenv("DATABASE_URL", with_option)
    module = load(example_files[name])
    app = module.app
    headers = {"authorization": "Bearer secret-a", "idempotency-key": f"readme-{name}"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            first = await c.post("/orders", json={"item": "book"}, headers=headers)
            again = await c.post("/orders", json={"item": "book"}, headers=headers)
            anonymous = await c.post(
                "/orders", json={"item": "book"}, headers={"idempotency-key": "x"}
            )
    assert first.status_code == 201, first.text
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"] == "Bearer"  # RFC 9110's challenge
    rows = await pool.fetch("SELECT tenant, item FROM orders")
    assert [tuple(r) for r in rows] == [("tenant-a", "book")]


def test_starlette_example_runs_without_fastapi(
    example_files: dict[str, Path], tmp_path: Path
) -> None:
    """The core and the Starlette example import nothing of FastAPI (it may not be installed)."""
    script = tmp_path / "no_fastapi.py"
    script.write_text(
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'fastapi' or name.startswith('fastapi.'):\n"
        "            raise ImportError('fastapi is not installed')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"sys.path.insert(0, {str(example_files['starlette'].parent)!r})\n"
        "import readme_starlette\n"
        "assert 'fastapi' not in sys.modules\n"
        "print('ok', type(readme_starlette.app).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok Starlette"


#: Wraps the plugin's `idem_replay` in the inner run: a line in replays.log per replay it checked.
RECORD_REPLAYS = """
from pathlib import Path

import pytest


@pytest.fixture
def idem_replay(idem_replay):
    async def recorded(*args, **kwargs):
        first, second = await idem_replay(*args, **kwargs)
        replayed = second.headers.get("idempotent-replayed")
        same = second.content == first.content
        with open(Path(__file__).parent / "replays.log", "a") as log:
            log.write(f"{first.status_code} {second.status_code} {replayed} {same}\\n")
        return first, second

    return recorded
"""


@pytest.fixture
def readme_test(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> Path:
    """The README's test and app as the files it names, with the replay recorder beside them."""
    use_this_server(pytester, monkeypatch, pg_dsn)
    pytester.makepyfile(test_app=example(README_TEST))
    pytester.makeconftest(RECORD_REPLAYS)
    return pytester.path / "replays.log"


def test_the_readme_test_passes_and_checks_a_replay(
    pytester: pytest.Pytester, readme_test: Path
) -> None:
    pytester.makepyfile(app=example(EXAMPLES["sqlalchemy"]))
    result = run(pytester)
    result.assert_outcomes(passed=1)
    # It really sent the order twice and saw the second answered as a replay with the same body.
    assert readme_test.read_text().splitlines() == ["201 201 true True"]


def test_the_testing_pages_tests_pass(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_dsn: str
) -> None:
    use_this_server(pytester, monkeypatch, pg_dsn)
    pytester.makepyfile(test_testing_page=example(TESTING_EXAMPLE[1], TESTING_EXAMPLE[0]))
    run(pytester).assert_outcomes(passed=2)


def _writes_twice(app: str) -> str:
    line = "        session.add(row)\n"
    assert line in app, "the README app no longer adds `row` to the session"
    return app.replace(line, line + line.replace("row", "Order(tenant=idem.tenant, item='x')"))


@pytest.mark.parametrize("broken", ["kill switch", "writes twice"])
def test_the_readme_test_fails_against_a_broken_app(
    broken: str,
    pytester: pytest.Pytester,
    readme_test: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = example(EXAMPLES["sqlalchemy"])
    if broken == "kill switch":
        monkeypatch.setenv("IDEM_MIDDLEWARE_DISABLED", "1")  # no claim: nothing is replayed
    else:
        app = _writes_twice(app)  # a replay, but a second row the test must notice
    pytester.makepyfile(app=app)
    result = run(pytester)
    result.assert_outcomes(failed=1)


async def test_the_own_auth_example_answers_a_bad_token_401_before_any_claim(
    example_files: dict[str, Path], db_dsn: str, pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/fastapi.md: the resolver raises the dependency's own HTTPException(401) for a bad
    credential (one of bytes beyond ASCII too: a str `hmac.compare_digest` refused it with a
    TypeError, a 500), returns None for none; each is a 401 problem with its challenge, not a
    500, and the handler does not run. A good credential is served."""
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, tenant text, item text)"
    )
    await pool.execute("TRUNCATE orders")
    monkeypatch.setenv("DATABASE_URL", db_dsn)
    app = load(example_files["fastapi_own_auth"]).app
    credentials: list[dict[bytes, bytes]] = [
        {b"authorization": b"Bearer secret-b"},
        {b"authorization": b"Bearer secr\xe9t-a"},
        {},
    ]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            refused = [
                await c.post(
                    "/orders",
                    json={"item": "book"},
                    headers={**credential, b"idempotency-key": b"bad-%d" % n},
                )
                for n, credential in enumerate(credentials)
            ]
            served = await c.post(
                "/orders",
                json={"item": "book"},
                headers={"authorization": "Bearer secret-a", "idempotency-key": "bad-0"},
            )
    for r, detail in zip(refused, ["invalid token", "invalid token", None], strict=True):
        assert r.status_code == 401
        assert r.headers["content-type"] == "application/problem+json"
        assert r.headers.get_list("www-authenticate") == ["Bearer"]
        assert r.json()["type"].endswith(":unauthenticated")
        if detail is not None:
            assert r.json()["detail"] == detail
    assert served.status_code == 201  # the key a refusal saw is free: nothing was claimed
    assert await pool.fetchval("SELECT count(*) FROM orders") == 1


def test_the_readme_names_what_its_test_needs_beyond_the_app() -> None:
    """A user who installed what the README's run line installs, plus what its test says it
    needs, has every module the test imports (`httpx` was missing: not a FastAPI dependency)."""
    text = (ROOT / "README.md").read_text()
    installed = re.search(r"pip install 'idem-middleware\[fastapi,sqlalchemy\]'(.*)\n", text)
    needs = re.search(r"as `test_app.py` \(needs (.*?)\):", text)
    assert installed is not None
    assert needs is not None
    named = {*installed.group(1).split(), *re.findall(r"`([\w-]+)`", needs.group(1))}
    named = {name.replace("-", "_") for name in named} | {"pytest", "idem_middleware", "app"}
    named.discard("pytest_asyncio")  # a plugin: the test imports nothing of it
    imported = set(re.findall(r"^(?:from|import) (\w+)", example(README_TEST), re.MULTILINE))
    assert imported - named - set(sys.stdlib_module_names) == set()
