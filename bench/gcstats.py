"""The app's CPU and its garbage collector's share, per request, under wrk.

`python -m bench.gcstats [--variants bare,ours-memory,floor-memory] [--duration 6] [--repeats 2]
[--gc on|off] [--pin-app CPU]`

Each run is a fresh `uvicorn bench.app:create_app` process with `BENCH_GC_STATS=1`, which makes
the app time every collection (`gc.callbacks`) and answer `GET /bench/gc` with the passes and
seconds per generation and the process's CPU seconds since `GET /bench/gc/reset` (sent after
wrk's warm-up; GETs, which no variant guards). `--gc off` runs the app with the collector
disabled (what the requests cost without it; a diagnosis, not a configuration). Prints, per
run: req/s, the app's CPU per response, the collector's seconds per response by generation, and
both against bare's in the same repeat. `--pin-app CPU` runs each app on that CPU alone and
everything else (PostgreSQL, wrk, this process) on the other CPUs, so the app never shares its
core with the load or the database.

Why: under load the app process is what saturates, so its CPU per response is what its
throughput is the inverse of, and it is steadier than req/s on a shared machine. A request that
leaves GC-tracked objects behind (a stored record, a cache entry) costs more than its own work:
the collector's passes over everything that outlives them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from .app import VARIANTS
from .db import EmbeddedPostgres, database_name, prepare_database
from .server import app_server
from .wrk import MISSING_WRK, Load, run_wrk, wrk_path

#: The environment variable that turns the collector's timing on in `bench.app`.
ENV = "BENCH_GC_STATS"


class Collector:
    """Counts and times the collector's passes per generation, from `reset` on."""

    def __init__(self) -> None:
        self._started = 0.0
        self.reset()
        gc.callbacks.append(self._callback)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def reset(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.cpu_from = time.process_time()

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.passes[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started

    def as_json(self) -> dict[str, Any]:
        return {
            "passes": self.passes,
            "seconds": self.seconds,
            "cpu": time.process_time() - self.cpu_from,
            "enabled": gc.isenabled(),
        }


def install(app: Any) -> Collector:
    """`GET /bench/gc` (the counts) and `GET /bench/gc/reset` (start counting again) on a
    FastAPI app; with `BENCH_GC_STATS=off` the collector is disabled too."""
    if os.environ.get(ENV) == "off":
        gc.disable()
    collector = Collector()

    @app.get("/bench/gc")
    async def gc_stats() -> dict[str, Any]:
        return collector.as_json()

    @app.get("/bench/gc/reset")
    async def gc_reset() -> dict[str, Any]:
        collector.reset()
        return collector.as_json()

    return collector


def _call(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=10) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


@dataclass
class Run:
    variant: str
    repeat: int
    rps: float
    responses: int
    cpu_us: float
    gc_us: list[float]
    gc_passes: list[float]


def pinning(cpu: int | None) -> tuple[set[int], set[int]] | None:
    """The app's CPU and the others' (None: no pinning). Refuses a CPU this process may not use,
    and a machine with no other CPU for the load and the database."""
    if cpu is None:
        return None
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        raise ValueError(f"CPU {cpu} is not one this process may use ({sorted(allowed)})")
    if len(allowed) < 2:
        raise ValueError("pinning needs a second CPU for the load and the database")
    return {cpu}, allowed - {cpu}


def run_one(variant: str, dsn: str, repeat: int, args: argparse.Namespace, load: Load) -> Run:
    os.environ[ENV] = "off" if args.gc == "off" else "1"
    try:
        with app_server(variant, dsn, args.pool_size) as app:
            if args.pin_app is not None:
                # Its worker threads, started later, inherit this.
                os.sched_setaffinity(app.pid, {args.pin_app})
            run_wrk(app.url, "fresh", args.warmup, f"gw{repeat}{variant}", load)
            _call(app.url, "/bench/gc/reset")
            result = run_wrk(app.url, "fresh", args.duration, f"gm{repeat}{variant}", load)
            stats = _call(app.url, "/bench/gc")
    finally:
        del os.environ[ENV]
    n = max(result.n2xx, 1)
    return Run(
        variant,
        repeat,
        result.rps,
        result.n2xx,
        stats["cpu"] / n * 1e6,
        [s / n * 1e6 for s in stats["seconds"]],
        [p / n * 1000 for p in stats["passes"]],
    )


def markdown(runs: list[Run]) -> str:
    bare = {r.repeat: r for r in runs if r.variant == "bare"}
    lines = [
        "| variant | repeat | req/s | x bare | app CPU µs/response | x bare (bare's CPU / this) "
        "| GC µs/response (gen 0, 1, 2) | GC passes per 1,000 (gen 0, 1, 2) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        b = bare.get(r.repeat)
        rps = f"{r.rps / b.rps:.2f}x" if b else "—"
        cpu = f"{b.cpu_us / r.cpu_us:.2f}x" if b else "—"
        gc_us = ", ".join(f"{x:.1f}" for x in r.gc_us)
        passes = ", ".join(f"{x:.1f}" for x in r.gc_passes)
        lines.append(
            f"| {r.variant} | {r.repeat + 1} | {r.rps:,.0f} | {rps} | {r.cpu_us:,.0f} | {cpu} "
            f"| {sum(r.gc_us):.1f} ({gc_us}) | {passes} |"
        )
    if bare:
        lines.append("")
        for v in dict.fromkeys(r.variant for r in runs if r.variant != "bare"):
            ratios = [
                bare[r.repeat].cpu_us / r.cpu_us
                for r in runs
                if r.variant == v and r.repeat in bare
            ]
            if ratios:
                lines.append(f"{v}: app CPU ratio median {statistics.median(ratios):.2f}x bare")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gcstats", description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="bare,ours-memory,floor-memory")
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--pool-size", type=int, default=20)
    p.add_argument("--gc", choices=("on", "off"), default="on")
    p.add_argument("--pin-app", type=int, metavar="CPU", help="the app alone on this CPU")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or not set(variants) <= set(VARIANTS) or args.repeats < 1 or args.duration <= 0:
        p.error(f"--variants among {', '.join(VARIANTS)}; --repeats >= 1; --duration > 0")
    try:
        pinned = pinning(args.pin_app)
    except ValueError as exc:
        p.error(f"--pin-app: {exc}")
    if wrk_path() is None:
        print(MISSING_WRK, file=sys.stderr)
        return 2
    if pinned is not None:
        os.sched_setaffinity(0, pinned[1])  # PostgreSQL and wrk, started from here, inherit it
    load = Load()
    runs: list[Run] = []
    with EmbeddedPostgres() as pg:
        dsns = {v: asyncio.run(prepare_database(pg.dsn, database_name(v))) for v in variants}
        for repeat in range(args.repeats):
            for variant in variants:
                run = run_one(variant, dsns[variant], repeat, args, load)
                print(
                    f"repeat {repeat + 1} {variant:14} {run.rps:7.0f} req/s "
                    f"app CPU {run.cpu_us:6.0f} µs/response, GC {sum(run.gc_us):5.1f}",
                    file=sys.stderr,
                    flush=True,
                )
                runs.append(run)
    print(markdown(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
