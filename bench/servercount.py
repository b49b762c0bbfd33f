"""Instructions per response of each variant's real uvicorn process under wrk, by callgrind.

`python -m bench.servercount [--variants bare,floor-memory,ours-memory] [--duration 20]`

`bench.instructions` counts the ASGI app called in a loop; this counts the whole server under
load: `uvicorn bench.app:create_app` (one worker, loopback, uvloop and httptools when installed)
runs under valgrind's callgrind on one CPU, wrk's fresh keys warm it up, the counters are zeroed
(`callgrind_control -z`), wrk runs `--duration` seconds more (32 connections, every request
answered before the count is dumped with `callgrind_control -d`), and the instructions are
divided by the responses. The protocol, the event loop, the collector (its passes over what the
requests keep alive) and the middleware are all in it. Under valgrind the app runs some fifty
times slower, so a run answers a few hundred requests, and how they interleave moves the count
(two runs of bare: 1,334,726 and 1,401,249 per response): compare the variants of one
invocation. What the app's throughput becomes against bare's follows as bare's count over the
variant's, when the app is what saturates (see docs/performance-history.md for how well it does).

Needs valgrind and wrk; about three minutes per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from example_app.launcher import free_port

from .app import VARIANTS
from .db import EmbeddedPostgres, database_name, prepare_database
from .server import app_args
from .wrk import MISSING_WRK, Load, run_wrk, wrk_path

_TOTAL = re.compile(r"^(?:summary|totals): (\d+)", re.MULTILINE)
#: Under valgrind a request waits for 31 others at a fiftieth of the speed: wrk's timeout and
#: its drain (every request answered before the count ends) are long.
LOAD = Load(timeout=120.0, drain=30.0)


def dumped_total(text: str) -> int:
    """The instructions a callgrind dump counted (its `summary:` or `totals:` line)."""
    found = _TOTAL.search(text)
    if found is None:
        raise ValueError("not a callgrind dump: no summary or totals line")
    return int(found.group(1))


def count(variant: str, dsn: str, duration: float, warmup: float, tmp: Path) -> tuple[int, int]:
    """(instructions, responses) of one variant's measured run."""
    out = tmp / f"{variant}.callgrind"
    port = free_port()
    env = {
        **os.environ,
        "BENCH_VARIANT": variant,
        "BENCH_DSN": dsn,
        "BENCH_POOL_SIZE": "20",
        "PYTHONUNBUFFERED": "1",
    }
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "uvicorn",
        *app_args(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    url = f"http://127.0.0.1:{port}"
    with (tmp / f"{variant}.log").open("wb") as log:
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_ready(proc, url, tmp / f"{variant}.log")
        run_wrk(url, "fresh", warmup, f"sc-w-{variant}", LOAD)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        result = run_wrk(url, "fresh", duration, f"sc-m-{variant}", LOAD)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        dump = Path(f"{out}.1")
        return dumped_total(dump.read_text()), int(result.raw["received"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 600  # start-up under valgrind takes a minute or two
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited early:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError("the app under valgrind did not answer /healthz in 600 s")


def markdown(results: dict[str, tuple[int, int]]) -> str:
    per = {v: total / max(n, 1) for v, (total, n) in results.items()}
    bare = per.get("bare")
    lines = [
        "| variant | responses | instructions per response | over bare | bare's over this |",
        "|---|---|---|---|---|",
    ]
    for v, (_, n) in results.items():
        over = f"+{per[v] - bare:,.0f}" if bare and v != "bare" else "—"
        ratio = f"{bare / per[v]:.2f}x" if bare else "—"
        lines.append(f"| {v} | {n:,} | {per[v]:,.0f} | {over} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.servercount", description=__doc__.split("\n")[0]
    )
    p.add_argument("--variants", default="bare,floor-memory,ours-memory")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds of wrk")
    p.add_argument("--warmup", type=float, default=8.0)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or not set(variants) <= set(VARIANTS) or args.duration <= 0:
        p.error(f"--variants among {', '.join(VARIANTS)}; --duration > 0")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not installed (apt-get install valgrind)")
    if wrk_path() is None:
        print(MISSING_WRK, file=sys.stderr)
        return 2
    results: dict[str, tuple[int, int]] = {}
    with EmbeddedPostgres() as pg, tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            dsn = asyncio.run(prepare_database(pg.dsn, database_name(variant) + "_count"))
            results[variant] = count(variant, dsn, args.duration, args.warmup, Path(tmp))
            total, n = results[variant]
            print(f"{variant}: {total / max(n, 1):,.0f} per response", file=sys.stderr, flush=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
