"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

There is no Docker daemon where these tests run, so nothing is built or started by Docker. What can
be checked honestly is checked: the services and their start order, the healthcheck, the env
wiring against the postgres service's own settings, ports, that every command names a module or
console script that exists and accepts the flags it is given, and that the migration command
really migrates a database when run as the compose file runs it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
import yaml

from example_app.launcher import ROOT
from tests.conftest import _fresh_database


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = compose["services"]
    return found


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(part) for part in cmd]


def env(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment", {})
    if isinstance(raw, list):  # the `- KEY=value` form
        return dict(item.split("=", 1) for item in raw)
    return {k: str(v) for k, v in raw.items()}


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def published(service: dict[str, Any]) -> dict[int, int]:
    """{container port: host port} from `[host_ip:]host:container` entries."""
    ports = {}
    for entry in service.get("ports", []):
        *_, host, container = str(entry).split(":")
        ports[int(container)] = int(host)
    return ports


def test_services_and_start_order(services: dict[str, Any]) -> None:
    assert set(services) == {"postgres", "migrate", "app", "bank"}
    assert services["postgres"]["image"] == "postgres:18"
    for name in ("migrate", "app"):
        deps = services[name]["depends_on"]
        assert deps["postgres"] == {"condition": "service_healthy"}, name
    app_deps = services["app"]["depends_on"]
    assert app_deps["migrate"] == {"condition": "service_completed_successfully"}
    assert app_deps["bank"] == {"condition": "service_started"}
    assert services["migrate"].get("restart", "no") == "no"  # a one-shot job
    for name in ("migrate", "app", "bank"):
        assert services[name]["build"] in (".", {"context": "."}), name


def test_postgres_healthcheck_and_volume(services: dict[str, Any]) -> None:
    pg = services["postgres"]
    check = pg["healthcheck"]
    test = check["test"]
    words = shlex.split(test[1]) if test[0] == "CMD-SHELL" else test[1:]
    assert test[0] in {"CMD", "CMD-SHELL"}
    assert words[0] == "pg_isready"
    pg_env = env(pg)
    assert option(words, "-U") == pg_env["POSTGRES_USER"]
    assert option(words, "-d") == pg_env["POSTGRES_DB"]
    assert int(check["retries"]) >= 5  # a bounded wait, not a single probe
    # PostgreSQL 18 images declare their volume at /var/lib/postgresql (data in 18/docker).
    mounts = [str(v).split(":")[1] for v in pg.get("volumes", [])]
    assert mounts == ["/var/lib/postgresql"]


def test_database_url_matches_the_postgres_service(services: dict[str, Any]) -> None:
    pg_env = env(services["postgres"])
    assert "PGPORT" not in pg_env  # so the server listens on 5432
    urls = {name: env(services[name])["DATABASE_URL"] for name in ("migrate", "app")}
    assert urls["migrate"] == urls["app"]  # the app serves the database that was migrated
    url = urlsplit(urls["app"])
    assert url.scheme in {"postgres", "postgresql"}
    assert url.hostname == "postgres"  # the service name is its host on the compose network
    assert (url.port or 5432) == 5432
    assert url.username == pg_env["POSTGRES_USER"]
    assert url.password == pg_env["POSTGRES_PASSWORD"]
    assert url.path.lstrip("/") == pg_env["POSTGRES_DB"]


def test_bank_url_and_ports_are_consistent(services: dict[str, Any]) -> None:
    app_cmd, bank_cmd = command(services["app"]), command(services["bank"])
    app_port, bank_port = int(option(app_cmd, "--port")), int(option(bank_cmd, "--port"))
    # Inside a container the server must listen on all interfaces to be reachable at all.
    assert option(app_cmd, "--host") == option(bank_cmd, "--host") == "0.0.0.0"
    bank_url = urlsplit(env(services["app"])["BANK_URL"])
    assert (bank_url.scheme, bank_url.hostname, bank_url.port) == ("http", "bank", bank_port)
    assert app_port in published(services["app"])
    assert bank_port in published(services["bank"])
    assert "DATABASE_URL" not in env(services["bank"])


def test_commands_name_modules_and_scripts_that_exist(
    services: dict[str, Any], pyproject: dict[str, Any]
) -> None:
    app_cmd, bank_cmd = command(services["app"]), command(services["bank"])
    assert app_cmd[:3] == ["python", "-m", "example_app"]
    assert bank_cmd[:3] == ["python", "-m", "example_app.bank"]
    for cmd in (app_cmd, bank_cmd):
        # The module runs, and every flag the compose file passes is one it accepts.
        help_text = subprocess.run(
            [sys.executable, "-m", cmd[2], "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        for flag in (word for word in cmd[3:] if word.startswith("--")):
            assert flag in help_text, (cmd, flag)
    migrate_cmd = command(services["migrate"])
    assert migrate_cmd == ["idem-middleware", "migrate"]
    assert pyproject["project"]["scripts"]["idem-middleware"] == "idem_middleware.cli:main"


def test_dockerfile_builds_a_python_311_image_with_the_example_extra(
    pyproject: dict[str, Any],
) -> None:
    lines = [
        line.strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    (base,) = [line.split()[1] for line in lines if line.upper().startswith("FROM ")]
    image = re.fullmatch(r"python:(\d+)\.(\d+)(?:[.\-][\w.\-]*)?", base)
    assert image is not None, base
    assert (int(image[1]), int(image[2])) >= (3, 11)
    assert any(re.fullmatch(r'RUN pip install ["\']?\.\[example\]["\']?', line) for line in lines)
    assert "example" in pyproject["project"]["optional-dependencies"]
    copied = {part for line in lines if line.startswith("COPY ") for part in line.split()[1:-1]}
    # What `pip install .` needs: the build config, the readme and licence files it names (a
    # missing licence file is silently left out of the install), both packages.
    needed = {"pyproject.toml", pyproject["project"]["readme"], "idem_middleware", "example_app"}
    assert needed | set(pyproject["project"].get("license-files", [])) <= copied


def test_docker_compose_config_if_available() -> None:
    """Docker's own validation, where a Compose plugin exists (not on the usual test host)."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI")
    version = subprocess.run(
        [docker, "compose", "version"], capture_output=True, text=True, timeout=30, check=False
    )
    if version.returncode != 0:
        pytest.skip("no docker compose plugin")
    subprocess.run(
        [docker, "compose", "config", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    )


async def test_the_migration_service_command_migrates(
    services: dict[str, Any], admin_dsn: str
) -> None:
    """Run the migrate service's command as compose would, against a fresh database."""
    dsn = await _fresh_database(admin_dsn, "idem_compose_migrate")
    script = Path(sys.executable).with_name(command(services["migrate"])[0])
    assert script.exists(), "the idem-middleware console script is not installed"
    run_env = {k: v for k, v in os.environ.items() if k != "IDEM_DATABASE_URL"}
    run_env["DATABASE_URL"] = dsn  # the compose env, pointed at the test server
    proc = await asyncio.create_subprocess_exec(
        str(script),
        *command(services["migrate"])[1:],
        env=run_env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(60):
            output, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, output.decode(errors="replace")
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('idem_requests') IS NOT NULL")
    finally:
        await conn.close()
