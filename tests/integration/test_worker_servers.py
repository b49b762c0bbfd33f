"""The middleware under pre-forking servers: two worker processes on one store, as a team deploys
it. gunicorn with its own ASGI worker (`-k asgi`) and with uvicorn's (`uvicorn_worker`), and
granian when it is installed (a compiled wheel; the others are in the test extras). Each test
starts the server as a process group of its own on 127.0.0.1 (tests/servers_app.py), holds
handlers at gates other processes can open, and speaks HTTP/1.1 over keep-alive connections: a
connection stays with the worker that accepted it, so a test can send a request to each worker.

- A duplicate on the other worker waits (lease mode: woken by LISTEN/NOTIFY; transactional: it
  polls) and is answered the original's response: one effect. Under gunicorn's ASGI worker the
  duplicate was answered gunicorn's plain-text 500 instead: its client watch cancelled a
  receive() each round of waiting, which that worker takes for the client gone.
- A worker SIGKILLed mid-request: the transactional key is free, the duplicate waiting on the
  other worker runs it, once; a lease-mode record lapses to `unknown`, no effect made.
- SIGTERM with a request in flight: it is answered, the server exits, and a retry after a
  restart is replayed.
- A misconfigured middleware fails the startup: the server exits non-zero and names the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from example_app.launcher import free_port
from tests.apps.servers import read_response
from tests.servers_app import EFFECTS

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]
#: The most any condition is waited for (each wait ends on its condition).
BOUND = 30.0
APP = "tests.servers_app:create_app"


def _gunicorn(worker: str) -> list[str]:
    command = [sys.executable, "-m", "gunicorn", "-w", "2", "-k", worker, "--keep-alive", "60"]
    command += ["--graceful-timeout", "30", "--timeout", "60"]
    from gunicorn.config import KNOWN_SETTINGS

    if any(setting.name == "control_socket_disable" for setting in KNOWN_SETTINGS):
        command.append("--no-control-socket")  # (gunicorn 27's, one path per user otherwise)
    return [*command, "-b", "127.0.0.1:{port}", APP + "()"]


def _available(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


SERVERS = {
    "gunicorn-asgi": (("gunicorn.workers.gasgi",), lambda: _gunicorn("asgi")),
    "gunicorn-uvicorn": (
        ("gunicorn", "uvicorn_worker"),
        lambda: _gunicorn("uvicorn_worker.UvicornWorker"),
    ),
    # (--respawn-failed-workers: without it, one worker's death stops the whole server.)
    "granian": (
        ("granian",),
        lambda: [
            *(sys.executable, "-m", "granian", "--interface", "asgi", "--workers", "2"),
            *("--respawn-failed-workers", "--host", "127.0.0.1", "--port", "{port}"),
            *("--factory", APP),
        ],
    ),
}


class Server:
    """One server process group; `start` again after it exited starts a fresh one."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.command = [part.format(port=self.port) for part in command]
        self.env = env
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    async def exited(self) -> int:
        """Its exit status, once it exits (the loop runs meanwhile: closed connections close)."""
        proc = self.proc
        assert proc is not None
        for _ in range(int(BOUND / 0.05)):
            if proc.poll() is not None:
                return proc.returncode
            await asyncio.sleep(0.05)
        pytest.fail(f"the server did not exit:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    async def answers(self, request: bytes = b"GET /ping HTTP/1.1\r\nhost: t\r\n\r\n") -> bool:
        """Whether the server answers `request` now: False while nothing listens on its port
        (fails if its process exited)."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            assert self.proc is not None
            assert self.proc.poll() is None, self.tail()
            return False
        try:
            writer.write(request)
            await asyncio.wait_for(read_response(reader), BOUND)
        finally:
            writer.close()
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(BOUND)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(BOUND)


@pytest.fixture(params=list(SERVERS))
def server(request: pytest.FixtureRequest, db_dsn: str, tmp_path: Path) -> Iterator[Server]:
    modules, command = SERVERS[request.param]
    if not _available(*modules):
        pytest.skip(f"{request.param}: {', '.join(modules)} not installed")
    gates = tmp_path / "gates"
    gates.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SERVERS_APP_DSN": db_dsn,
        "SERVERS_APP_GATES": str(gates),
    }
    proc = Server(command(), env, tmp_path / "server.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def db(db_dsn: str) -> AsyncIterator[asyncpg.Pool[Any]]:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    try:
        await pool.execute(EFFECTS)
        await pool.execute("TRUNCATE idem_requests, servers_effects")
        yield pool
    finally:
        await pool.close()


class Connection:
    """A keep-alive connection, and the worker (PID) that accepted it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.pid = 0

    def send(self, method: str, path: str, key: str | None = None) -> None:
        body = b'{"amount": 5}' if method == "POST" else b""
        head = [f"{method} {path} HTTP/1.1", "host: test", f"content-length: {len(body)}"]
        if key is not None:
            head += [f"idempotency-key: {key}", "content-type: application/json"]
        self.writer.write("\r\n".join(head).encode() + b"\r\n\r\n" + body)

    async def answer(self) -> tuple[int, dict[bytes, bytes], bytes]:
        return await asyncio.wait_for(read_response(self.reader), BOUND)

    async def state(self) -> dict[str, int]:
        self.send("GET", "/state")
        status, _, body = await self.answer()
        assert status == 200
        state: dict[str, int] = json.loads(body)
        return state

    def close(self) -> None:
        self.writer.close()


async def until(predicate: Any, what: str) -> None:
    for _ in range(int(BOUND / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def workers(server: Server) -> AsyncIterator[tuple[Connection, Connection, Connection]]:
    """Keep-alive connections: one to a worker, two to the other."""
    by_pid: dict[int, list[Connection]] = {}
    opened: list[Connection] = []

    async def connected() -> bool:
        try:
            conn = Connection(*await asyncio.open_connection("127.0.0.1", server.port))
        except OSError:
            assert server.proc is not None
            assert server.proc.poll() is None, f"the server exited:\n{server.tail()}"
            return False
        opened.append(conn)
        conn.pid = (await conn.state())["pid"]
        by_pid.setdefault(conn.pid, []).append(conn)
        return len(by_pid) == 2 and all(len(c) >= 2 for c in by_pid.values())

    try:
        await until(connected, "connections to both workers")
        first, second = by_pid.values()
        yield first[0], second[0], second[1]
    finally:
        for conn in opened:
            conn.close()


def gates(server: Server) -> Path:
    return Path(server.env["SERVERS_APP_GATES"])


async def entered(server: Server, key: str) -> int:
    """The PID of the worker whose handler runs `key`, once it runs."""
    mark = gates(server) / f"{key}.entered"

    async def exists() -> bool:
        return mark.exists() and mark.read_text() != ""

    await until(exists, f"the handler of {key}")
    return int(mark.read_text())


def open_gate(server: Server, key: str) -> None:
    (gates(server) / f"{key}.open").touch()


async def effects(db: asyncpg.Pool[Any], key: str) -> int:
    n: int = await db.fetchval("SELECT count(*) FROM servers_effects WHERE k = $1", key)
    return n


async def states(db: asyncpg.Pool[Any], key: str) -> list[str]:
    rows = await db.fetch("SELECT state FROM idem_requests WHERE idem_key = $1", key)
    return [row["state"] for row in rows]


async def waiting(db: asyncpg.Pool[Any], mode: str, watcher: Connection) -> bool:
    """Whether the duplicate waits: registered for a notification (lease mode), or counted
    among the waiters of its worker (transactional, read over another connection to it)."""
    if mode == "lease":
        return bool(await db.fetchval("SELECT count(*) FROM idem_waiters"))
    return (await watcher.state())["waiters"] >= 1


PATHS = {"transactional": "/credits/{key}", "lease": "/payouts/{key}"}


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_a_duplicate_on_the_other_worker_gets_the_replay(
    server: Server, db: asyncpg.Pool[Any], mode: str
) -> None:
    key = f"dup-{mode}"
    path = PATHS[mode].format(key=key)
    async with workers(server.start()) as (a, b, watcher):
        a.send("POST", path, key)
        assert await entered(server, key) == a.pid
        b.send("POST", path, key)

        async def duplicate_waits() -> bool:
            return await waiting(db, mode, watcher)

        await until(duplicate_waits, "the duplicate's wait")
        # Several rounds of its wait (polls of 20 ms doubling; a watch of its client each).
        await asyncio.sleep(1.0)
        open_gate(server, key)
        original, replay = await a.answer(), await b.answer()
    assert (original[0], original[1].get(b"idempotent-replayed")) == (201, None)
    # (It was a plain-text 500 under gunicorn's ASGI worker.)
    assert (replay[0], replay[1].get(b"idempotent-replayed")) == (201, b"true")
    assert replay[1][b"x-pid"] == str(b.pid).encode()
    assert replay[2] == original[2]
    assert (await effects(db, key), await states(db, key)) == (1, ["succeeded"])


async def test_a_worker_killed_mid_request_leaves_the_key_to_the_other_worker(
    server: Server, db: asyncpg.Pool[Any]
) -> None:
    key = "killed"
    async with workers(server.start()) as (a, b, watcher):
        a.send("POST", f"/credits/{key}", key)
        assert await entered(server, key) == a.pid
        b.send("POST", f"/credits/{key}", key)

        async def duplicate_waits() -> bool:
            return await waiting(db, "transactional", watcher)

        await until(duplicate_waits, "the duplicate's wait")
        (gates(server) / f"{key}.entered").write_text("")
        os.kill(a.pid, signal.SIGKILL)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await a.answer()
        # The claim rolled back with the dead worker's connection: the duplicate claims it.
        assert await entered(server, key) == b.pid
        open_gate(server, key)
        status, headers, body = await b.answer()
    # The master's new worker, once up: stopped while it boots, gunicorn's ASGI worker and
    # granian's miss the shutdown and hold the stop for the whole graceful timeout (30 s).
    async with workers(server):
        pass
    assert (status, headers.get(b"idempotent-replayed")) == (201, None)
    assert json.loads(body)["pid"] == b.pid
    assert (await effects(db, key), await states(db, key)) == (1, ["succeeded"])


async def test_a_lease_whose_worker_was_killed_lapses_to_unknown(
    server: Server, db: asyncpg.Pool[Any]
) -> None:
    key = "killed-lease"
    async with workers(server.start()) as (a, b, _):
        a.send("POST", f"/payouts/{key}", key)
        assert await entered(server, key) == a.pid
        os.kill(a.pid, signal.SIGKILL)
        b.send("POST", f"/payouts/{key}", key)  # waits for the lease (2 s) to lapse
        status, headers, body = await b.answer()
    assert (status, headers[b"content-type"]) == (409, b"application/problem+json")
    assert json.loads(body)["type"].endswith("outcome-unknown")
    assert (await effects(db, key), await states(db, key)) == (0, ["unknown"])


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_sigterm_answers_the_request_in_flight_and_the_retry_is_replayed(
    server: Server, db: asyncpg.Pool[Any], mode: str
) -> None:
    key = f"deploy-{mode}"
    path = PATHS[mode].format(key=key)
    async with workers(server.start()) as (a, _, _):
        a.send("POST", path, key)
        await entered(server, key)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGTERM)  # the master: a graceful shutdown
        open_gate(server, key)
        status, _, body = await a.answer()
    assert status == 201
    assert await server.exited() == 0
    assert (await effects(db, key), await states(db, key)) == (1, ["succeeded"])
    async with workers(server.start()) as (a, _, _):
        a.send("POST", path, key)
        retry = await a.answer()
    assert (retry[0], retry[1][b"idempotent-replayed"], retry[2]) == (201, b"true", body)


async def test_a_misconfigured_middleware_fails_the_startup(server: Server) -> None:
    server.env["SERVERS_APP_MISCONFIGURED"] = "1"
    # (Without granian's respawning: a worker whose startup fails after its sibling's started
    # is respawned, and fails again, for as long as the server runs.)
    if "--respawn-failed-workers" in server.command:
        server.command.remove("--respawn-failed-workers")
    assert await server.start().exited() != 0
    assert "policies['POST /payout/{k}'] matches no route" in server.tail()
