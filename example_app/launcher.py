"""Starting and stopping an app as a subprocess on a loopback port, by PID.

One launcher for the tour (`python -m example_app.tour`), the end-to-end tests and the
benchmarks: all three run from a checkout, where `example_app` is importable (it is not installed
by pip). The child runs in its own process group, so a kill takes its workers with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx

#: The checkout: the default working directory of a child (`python -m example_app` finds it).
ROOT = Path(__file__).resolve().parent.parent


class ServerFailed(RuntimeError):
    """The process exited, or did not answer in time; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stop_embedded_postgres(pgdata: Path) -> None:
    """Stop a PostgreSQL the app left running (a SIGKILLed app runs no exit hooks).

    The postmaster runs in its own session, so killing the app's process group spares it.
    SIGINT is PostgreSQL's "fast shutdown"; SIGQUIT (immediate) if it is still up after 10 s.
    """
    pid_file = pgdata / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    for signum in (signal.SIGINT, signal.SIGQUIT):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and pid_file.exists():
            time.sleep(0.1)
        if not pid_file.exists():
            return


class ServerProcess:
    """`python -m <module> <args> --host 127.0.0.1 --port <free port>` in its own process group.

    `env` is added to this process's environment less the names in `unset`. The server is ready
    once `ready_path` answers (with `ready_status`, if given). Its output goes to `log_path`
    (default: a file in the temp directory, removed by `cleanup`).
    """

    def __init__(
        self,
        module: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        unset: Iterable[str] = (),
        cwd: Path | None = None,
        ready_path: str = "/",
        ready_status: int | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.module = module
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"idem-{module}-{self.port}.log"
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        dropped = set(unset)
        inherited = {name: value for name, value in os.environ.items() if name not in dropped}
        self.env = {**inherited, **(env or {})}
        # The child imports this checkout's packages, whatever its working directory.
        path = self.env.get("PYTHONPATH")
        self.env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)
        self.cwd = cwd or ROOT
        self.ready_path = ready_path
        self.ready_status = ready_status
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> ServerProcess:
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                cwd=self.cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.module} exited early:\n{self.log()}")
            if self._ready():
                return self
            time.sleep(0.1)
        self.stop()
        raise ServerFailed(f"{self.module} did not start in {timeout:.0f}s:\n{self.log()}")

    def _ready(self) -> bool:
        try:
            status = httpx.get(self.url + self.ready_path, timeout=1.0).status_code
        except httpx.TransportError:
            return False
        return self.ready_status is None or status == self.ready_status

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group (the app and its workers): a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM to the group (the app runs its shutdown), SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()

    def cleanup(self) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
