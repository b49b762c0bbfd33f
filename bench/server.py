"""One benchmark app in its own `uvicorn` process (1 worker, 127.0.0.1), started and stopped by
PID with the example app's launcher."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from example_app.launcher import ServerProcess


def uvicorn_speedups() -> list[str]:
    """`--loop uvloop --http httptools` when they are installed (the bench extra installs them)."""
    args = []
    if importlib.util.find_spec("uvloop") is not None:
        args += ["--loop", "uvloop"]
    if importlib.util.find_spec("httptools") is not None:
        args += ["--http", "httptools"]
    return args


def app_args() -> list[str]:
    """uvicorn's arguments for `bench.app` (one worker, its speedups, quiet), but the address."""
    return [
        "bench.app:create_app",
        "--factory",
        "--workers",
        "1",
        *uvicorn_speedups(),
        "--no-access-log",
        "--log-level",
        "warning",
    ]


def app_server(variant: str, dsn: str, pool_size: int) -> ServerProcess:
    """`uvicorn bench.app:create_app --factory` for one variant, on a free loopback port; ready
    once `/healthz` answers 200. Use it as a context manager (started, then stopped and its log
    removed)."""
    return ServerProcess(
        "uvicorn",
        *app_args(),
        env={
            "BENCH_VARIANT": variant,
            "BENCH_DSN": dsn,
            "BENCH_POOL_SIZE": str(pool_size),
            "PYTHONUNBUFFERED": "1",
        },
        ready_path="/healthz",
        ready_status=200,
    )


def read_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in bytes, from /proc/<pid>/status."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out
