"""Running wrk with a scenario's Lua script and reading the JSON its `done()` prints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LUA_DIR = Path(__file__).resolve().parent / "lua"
#: Scenario -> Lua script.
SCRIPTS = {"fresh": "fresh.lua", "replay": "replay.lua", "dup": "dup.lua", "get": "get.lua"}
BODY = '{"amount": 5}'
MISSING_WRK = (
    "wrk is not installed (or not on PATH); the benchmark needs it to generate load.\n"
    "Install it with:  apt-get install -y wrk   (Debian/Ubuntu; 4.1.0 is known to work)"
)


def wrk_path() -> str | None:
    return shutil.which("wrk")


def wrk_version() -> str:
    path = wrk_path()
    if path is None:
        return "missing"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    text = (out.stdout or out.stderr).strip()
    return text.split(" Copyright")[0].strip() if text else "?"


@dataclass(frozen=True)
class Load:
    connections: int = 32
    threads: int = 1
    #: Seconds of measured load; wrk runs `drain` seconds longer, sending nothing new.
    drain: float = 2.0
    timeout: float = 10.0
    accounts: int = 100
    replay_keys: int = 256
    dup_group: int = 8
    token: str = "bench-token"


@dataclass(frozen=True)
class WrkResult:
    raw: dict[str, Any]
    stdout: str

    @property
    def rps(self) -> float:
        return float(self.raw["window"]) / float(self.raw["duration_s"])

    def latency_ms(self, p: str) -> float:
        return float(self.raw["latency_us"][p]) / 1000.0

    @property
    def n2xx(self) -> int:
        return int(self.raw["n2xx"])

    @property
    def received(self) -> int:
        return int(self.raw["received"])

    @property
    def sent(self) -> int:
        return int(self.raw["sent"])

    @property
    def distinct_2xx_keys(self) -> int:
        return int(self.raw.get("distinct_2xx_keys", 0))

    @property
    def statuses(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.raw.get("statuses", {}).items()}

    @property
    def socket_errors(self) -> dict[str, int]:
        e = self.raw["errors"]
        return {k: int(e[k]) for k in ("connect", "read", "write", "timeout") if int(e[k])}


def run_wrk(
    url: str, scenario: str, duration: float, prefix: str, load: Load, *, track_keys: bool = False
) -> WrkResult:
    path = wrk_path()
    if path is None:
        raise SystemExit(MISSING_WRK)
    env = {
        **os.environ,
        "BENCH_LUA_DIR": str(LUA_DIR),
        "BENCH_PREFIX": prefix,
        "BENCH_DURATION": str(duration),
        "BENCH_TOKEN": load.token,
        "BENCH_BODY": BODY,
        "BENCH_ACCOUNTS": str(load.accounts),
        "BENCH_REPLAY_KEYS": str(load.replay_keys),
        "BENCH_DUP_GROUP": str(load.dup_group),
        "BENCH_TRACK_KEYS": "1" if track_keys else "0",
    }
    total = max(1, round(duration + load.drain))
    command = [
        path,
        "-t",
        str(load.threads),
        "-c",
        str(load.connections),
        "-d",
        f"{total}s",
        "--timeout",
        f"{load.timeout:g}s",
        "-s",
        str(LUA_DIR / SCRIPTS[scenario]),
        url,
    ]
    out = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=total + 60, check=False
    )
    for line in out.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return WrkResult(json.loads(line.removeprefix("BENCH_RESULT ")), out.stdout)
    raise RuntimeError(
        f"wrk printed no result (exit {out.returncode}):\n{out.stdout}\n{out.stderr}"
    )
