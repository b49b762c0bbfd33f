"""The request-by-request loop (bench/paired.py) in several fresh processes, one after another.

`python -m bench.paired_runs [--processes 5] [--requests 12000] [--warmup 500]`

Within one process, bare, the `MemoryStore` middleware and the floor (bench/floor.py) take turns
request by request, so the machine's drift hits them alike. What one process cannot cancel is
where its code and data land in memory: two copies of the same package imported into one process
differed by 1.2 µs in one run and 9.5 µs in the next, of the order of the gap to the issue's
target. Each process here lands them afresh; the table gives each process's shares, then their
median and range. Read the median of the processes, not one of them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from idem_middleware import MemoryStore

from .asgi import Variant, build_app, make_requests
from .paired import loop_runner, measure_paired

ROOT = Path(__file__).resolve().parents[1]
BARE = "bare"
VARIANTS = ("bare", "ours-memory", "floor-memory")


async def warmed_and_paired(
    apps: dict[str, Any], requests: int, warmup: int
) -> tuple[dict[str, list[float]], dict[int, int]]:
    """`apps` warmed up (`warmup` requests each, untimed), then timed request by request
    (`measure_paired`, `bench.asgi`'s requests); the µs per app, and the statuses of the timed
    requests."""
    counted = Variant("paired", None, 0, 1)  # (bench.asgi's: its send counts the statuses)
    send = counted.send()
    for app in apps.values():
        for scope, receive in make_requests("warm", warmup):
            await app(scope, receive, send)
    counted.statuses.clear()
    gc.collect()
    gc.freeze()
    times = await measure_paired(apps, requests, send, make_requests)
    return times, dict(counted.statuses)


async def _child(requests: int, warmup: int) -> dict[str, Any]:
    """One process's loop: each variant's median and mean µs, and the statuses it saw."""
    apps = {
        name: build_app(name, MemoryStore() if name == "ours-memory" else None) for name in VARIANTS
    }
    times, statuses = await warmed_and_paired(apps, requests, warmup)
    return {
        "times": {n: [statistics.median(t), statistics.fmean(t)] for n, t in times.items()},
        "statuses": statuses,
    }


def shares(times: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Each variant's (median, mean) over bare's, less one: what it adds, as a share of bare."""
    base = times[BARE]
    return {n: (t[0] / base[0] - 1, t[1] / base[1] - 1) for n, t in times.items() if n != BARE}


def markdown(runs: list[dict[str, Any]]) -> str:
    """A row per process, then the median and range of each share over the processes."""
    lines = [
        "| process | bare median µs | "
        + " | ".join(f"{n} adds, x bare: median / mean" for n in VARIANTS[1:])
        + " |",
        "|---|---|" + "---|" * (len(VARIANTS) - 1),
    ]
    per = [shares(run["times"]) for run in runs]
    for i, (run, s) in enumerate(zip(runs, per, strict=True), 1):
        cells = " | ".join(f"{s[n][0]:.2f}x / {s[n][1]:.2f}x" for n in VARIANTS[1:])
        lines.append(f"| {i} | {run['times'][BARE][0]:,.1f} | {cells} |")
    summary = []
    for n in VARIANTS[1:]:
        medians, means = [s[n][0] for s in per], [s[n][1] for s in per]
        summary.append(
            f"{statistics.median(medians):.2f}x ({min(medians):.2f}-{max(medians):.2f}) / "
            f"{statistics.median(means):.2f}x ({min(means):.2f}-{max(means):.2f})"
        )
    lines.append(f"| **median (range) of the processes** | | {' | '.join(summary)} |")
    return "\n".join(lines)


def _sizes(args: argparse.Namespace) -> list[str]:
    return ["--requests", str(args.requests), "--warmup", str(args.warmup)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.paired_runs", description=__doc__.split("\n")[0]
    )
    p.add_argument("--processes", type=int, default=5, help="fresh processes, one after another")
    p.add_argument("--requests", type=int, default=12_000, help="timed requests per variant")
    p.add_argument("--warmup", type=int, default=500, help="untimed requests per variant")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.processes < 1 or args.requests < 1 or args.warmup < 0:
        p.error("--processes and --requests must be at least 1, --warmup at least 0")
    if args.child:
        print(json.dumps(loop_runner()(_child(args.requests, args.warmup))))
        return 0
    runs = []
    for i in range(args.processes):
        done = subprocess.run(
            [sys.executable, "-m", "bench.paired_runs", "--child", *_sizes(args)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "PYTHONHASHSEED": str(i)},
        )
        if done.returncode != 0:
            raise SystemExit(f"process {i + 1} failed:\n{done.stderr[-2000:]}")
        run = json.loads(done.stdout.splitlines()[-1])
        if set(run["statuses"]) != {"201"}:  # (JSON's keys are strings)
            raise SystemExit(f"process {i + 1}: unexpected statuses {run['statuses']}")
        runs.append(run)
        added = ", ".join(f"{n} {m:.2f}x" for n, (m, _) in shares(run["times"]).items())
        print(f"process {i + 1}: {added} (medians)", file=sys.stderr, flush=True)
    print(
        f"- command: python -m bench.paired_runs {' '.join(sys.argv[1:] if argv is None else argv)}"
    )
    print(f"- {args.requests} timed requests per variant per process, warm-up {args.warmup}\n")
    print(markdown(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
