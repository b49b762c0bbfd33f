"""schemathesis against the example app's OpenAPI schema: no 5xx, responses conform."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from example_app.launcher import ServerProcess
from tests.conftest import _fresh_database


@pytest.fixture(scope="module")
async def app_db(admin_dsn: str) -> str:
    return await _fresh_database(admin_dsn, "idem_schemathesis")


@pytest.fixture(scope="module")
def server(app_db: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "example_app",
        env={"DATABASE_URL": app_db, "EXAMPLE_WAIT_SECONDS": "0.5"},
        ready_path="/openapi.json",
    ).start()
    try:
        yield proc
    finally:
        proc.cleanup()


def test_no_server_errors_and_conforming_responses(server: ServerProcess, tmp_path: Path) -> None:
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert cli is not None
    result = subprocess.run(
        [
            cli,
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,"
            "response_schema_conformance,response_headers_conformance",
            "--max-examples",
            "40",
            "--seed",
            "20261130",
            "--generation-deterministic",
            "--request-timeout",
            "10",
            "--header",
            "Authorization: Bearer demo-a",
            "--phases",
            "examples,coverage,fuzzing",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
