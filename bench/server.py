"""One benchmark app in its own `uvicorn` process (1 worker, 127.0.0.1), started and stopped by
PID."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def uvicorn_speedups() -> list[str]:
    """`--loop uvloop --http httptools` when they are installed (the bench extra installs them)."""
    args = []
    if importlib.util.find_spec("uvloop") is not None:
        args += ["--loop", "uvloop"]
    if importlib.util.find_spec("httptools") is not None:
        args += ["--http", "httptools"]
    return args


class AppServer:
    """`uvicorn bench.app:create_app --factory` for one variant, on a free loopback port."""

    def __init__(self, variant: str, dsn: str, pool_size: int) -> None:
        self.variant = variant
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, log = tempfile.mkstemp(prefix=f"idem-bench-{variant}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log)
        self.env = {
            **os.environ,
            "BENCH_VARIANT": variant,
            "BENCH_DSN": dsn,
            "BENCH_POOL_SIZE": str(pool_size),
            "PYTHONUNBUFFERED": "1",
        }
        self.command = [
            sys.executable,
            "-m",
            "uvicorn",
            "bench.app:create_app",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            *uvicorn_speedups(),
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> AppServer:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.variant} app exited early:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.variant} app did not start in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the process (by PID), SIGKILL to its group if it does not exit in time."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def cleanup(self) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> AppServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def read_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in bytes, from /proc/<pid>/status."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out
