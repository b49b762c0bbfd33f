"""The README's Starlette and FastAPI examples: type-checked with mypy --strict, and run."""

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

ROOT = Path(__file__).resolve().parents[2]


def example(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, f"no python block under {heading!r}"
    return match.group(1)


EXAMPLES = {"starlette": "Minimal Starlette app", "fastapi": "Minimal FastAPI app"}


@pytest.fixture(scope="module")
def example_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("readme")
    files = {}
    for name, heading in EXAMPLES.items():
        path = folder / f"readme_{name}.py"
        path.write_text(example(heading))
        files[name] = path
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


@pytest.mark.parametrize("name", sorted(EXAMPLES))
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
    monkeypatch.setenv("DATABASE_URL", db_dsn)
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
