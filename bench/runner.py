"""`python -m bench`: every variant x scenario, interleaved and repeated, with a correctness check
after every run, then the round-trip and memory measurements, written as JSON and Markdown."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import report
from .app import TOKEN, VARIANTS
from .db import (
    ACCOUNTS,
    EmbeddedPostgres,
    LedgerDelta,
    database_name,
    ledger_mark,
    ledger_since,
    prepare_database,
    reset_for_run,
    server_info,
    wait_idle,
)
from .noise import CpuMeter
from .server import app_server, uvicorn_speedups
from .wrk import BODY, MISSING_WRK, SCRIPTS, Load, WrkResult, run_wrk, wrk_path, wrk_version

SCENARIOS = tuple(SCRIPTS)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest"
#: What each variant needs installed (pip install -e '.[bench]').
_IMPORTS = {
    "ours-tx-sqla": ("sqlalchemy",),
    "fastidempotent": ("fastidempotent", "sqlalchemy"),
    "fastapi-idempotency": ("fastapi_idempotency", "tortoise"),
}


@dataclass
class Run:
    repeat: int
    variant: str
    scenario: str
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    sent: int
    received: int
    n2xx: int
    non2xx: int
    statuses: dict[str, int]
    socket_errors: dict[str, int]
    replayed: int
    distinct_2xx_keys: int
    rows: int
    row_keys: int
    duplicate_rows: int
    correct: bool
    check: str
    cpu: dict[str, float] = field(default_factory=dict)
    loadavg: float = 0.0
    app_errors: int = 0
    seeded: int | None = None


def check(variant: str, scenario: str, r: WrkResult, d: LedgerDelta) -> tuple[bool, str]:
    """Rows written against 2xx received: (correct, what was compared)."""
    unanswered = r.sent - r.received
    non2xx = r.received - r.n2xx
    notes = []
    if unanswered:
        notes.append(f"{unanswered} requests unanswered when wrk stopped")
    if scenario == "fresh":
        if unanswered:
            ok = r.n2xx <= d.rows <= r.n2xx + unanswered and d.duplicate_rows == 0
        else:
            ok = d.rows == r.n2xx and d.duplicate_rows == 0
        text = f"rows {d.rows} = 2xx {r.n2xx}" if ok else f"rows {d.rows} != 2xx {r.n2xx}"
    elif scenario == "replay" and variant == "bare":
        # Not idempotent: a "replay" runs the handler again, like a fresh request.
        ok = d.rows == r.n2xx if not unanswered else d.rows >= r.n2xx
        text = f"rows {d.rows} = 2xx {r.n2xx} (not idempotent: replays write again)"
    elif scenario in ("replay", "get"):
        ok = d.rows == 0 and non2xx == 0
        what = "replays" if scenario == "replay" else "GETs"
        text = f"rows {d.rows}"
        if non2xx:
            text += f"; {non2xx} non-2xx to genuine {what}"
    else:  # dup
        if variant == "bare":
            ok = d.rows == r.n2xx if not unanswered else d.rows >= r.n2xx
            text = f"rows {d.rows} = 2xx {r.n2xx} (not idempotent: {d.duplicate_rows} repeats)"
        else:
            ok = d.rows == r.distinct_2xx_keys and d.duplicate_rows == 0
            text = f"rows {d.rows} vs keys with a 2xx {r.distinct_2xx_keys}"
            if d.duplicate_rows:
                text += f"; {d.duplicate_rows} keys written twice"
    if notes:
        text += " (" + "; ".join(notes) + ")"
    return ok, text


async def seed_replays(url: str, prefix: str, load: Load) -> int:
    """Complete the replay scenario's keys (the same key -> account mapping as replay.lua)."""
    sem = asyncio.Semaphore(8)
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:

        async def one(i: int) -> int:
            async with sem:
                r = await c.post(
                    f"/accounts/acc-{i % load.accounts}/credits",
                    content=BODY.encode(),
                    headers={"idempotency-key": f"{prefix}-r-{i}"},
                )
                return r.status_code

        statuses = await asyncio.gather(*(one(i) for i in range(load.replay_keys)))
    return sum(1 for s in statuses if 200 <= s < 300)


def run_one(
    variant: str,
    scenario: str,
    repeat: int,
    dsn: str,
    pg_pid: int | None,
    opts: argparse.Namespace,
    load: Load,
    run_id: str,
) -> Run:
    asyncio.run(reset_for_run(dsn))
    prefix = f"{run_id}{repeat}{VARIANTS.index(variant)}{scenario}"
    with app_server(variant, dsn, opts.pool_size) as app:
        seeded = None
        if scenario == "replay":
            seeded = asyncio.run(seed_replays(app.url, prefix, load))
        if opts.warmup > 0:
            warm_prefix = prefix if scenario == "replay" else prefix + "w"
            run_wrk(app.url, scenario, opts.warmup, warm_prefix, load)
        asyncio.run(wait_idle(dsn))
        mark = asyncio.run(ledger_mark(dsn))
        load_before = os.getloadavg()[0]
        with CpuMeter(pg_pid) as cpu:
            result = run_wrk(
                app.url, scenario, opts.duration, prefix, load, track_keys=scenario == "dup"
            )
        asyncio.run(wait_idle(dsn))
        delta = asyncio.run(ledger_since(dsn, mark))
        log = app.log()
    ok, text = check(variant, scenario, result, delta)
    if seeded is not None and seeded != load.replay_keys:
        ok = False
        text += f"; only {seeded}/{load.replay_keys} replay keys completed in the warm-up"
    app_errors = log.count("Traceback")
    return Run(
        repeat=repeat,
        variant=variant,
        scenario=scenario,
        rps=round(result.rps, 1),
        p50_ms=round(result.latency_ms("p50"), 2),
        p90_ms=round(result.latency_ms("p90"), 2),
        p99_ms=round(result.latency_ms("p99"), 2),
        sent=result.sent,
        received=result.received,
        n2xx=result.n2xx,
        non2xx=result.received - result.n2xx,
        statuses=result.statuses,
        socket_errors=result.socket_errors,
        replayed=int(result.raw.get("replayed", 0)),
        distinct_2xx_keys=int(result.raw.get("distinct_2xx_keys", 0)),
        rows=delta.rows,
        row_keys=delta.distinct_keys,
        duplicate_rows=delta.duplicate_rows,
        correct=ok,
        check=text,
        cpu=cpu.result(),
        loadavg=round(max(load_before, os.getloadavg()[0]), 2),
        app_errors=app_errors,
        seeded=seeded,
    )


def failed_run(repeat: int, variant: str, scenario: str, exc: Exception) -> Run:
    detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    return Run(
        repeat=repeat,
        variant=variant,
        scenario=scenario,
        rps=0.0,
        p50_ms=0.0,
        p90_ms=0.0,
        p99_ms=0.0,
        sent=0,
        received=0,
        n2xx=0,
        non2xx=0,
        statuses={},
        socket_errors={},
        replayed=0,
        distinct_2xx_keys=0,
        rows=0,
        row_keys=0,
        duplicate_rows=0,
        correct=False,
        check=f"run failed: {detail}",
    )


def _csv(value: str | None, known: tuple[str, ...], what: str) -> list[str]:
    if not value:
        return list(known)
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return items


def _missing_packages(variants: list[str]) -> list[str]:
    import importlib.util

    missing = []
    for v in variants:
        for module in _IMPORTS.get(v, ()):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{v} needs {module}")
    return missing


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Throughput, latency and correctness of idem_middleware against the bare app "
        "and peer libraries (see bench/README.md).",
    )
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--repeats", type=int, default=3, help="rounds over every variant x scenario")
    p.add_argument("--connections", type=int, default=32, help="wrk connections")
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run")
    p.add_argument(
        "--drain", type=float, default=2.0, help="seconds wrk waits for in-flight requests"
    )
    p.add_argument("--pool-size", type=int, default=20, help="asyncpg pool size of every app")
    p.add_argument("--variants", help=f"comma-separated; default all: {','.join(VARIANTS)}")
    p.add_argument("--scenarios", help=f"comma-separated; default all: {','.join(SCENARIOS)}")
    p.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="a directory (gets latest.json and latest.md) or a path without suffix "
        "(default: bench/results/latest)",
    )
    p.add_argument(
        "--roundtrips",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure statements per request path (default: on unless --variants/--scenarios)",
    )
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure peak RSS under 1 MiB bodies (default: on unless --variants/--scenarios)",
    )
    p.add_argument("--memory-requests", type=int, default=20, help="requests per memory phase")
    args = p.parse_args(argv)
    args.variant_list = _csv(args.variants, VARIANTS, "variants")
    args.scenario_list = _csv(args.scenarios, SCENARIOS, "scenarios")
    full = args.variants is None and args.scenarios is None
    args.roundtrips = full if args.roundtrips is None else args.roundtrips
    args.memory = full if args.memory is None else args.memory
    if args.duration <= 0 or args.repeats < 1:
        p.error("--duration must be positive and --repeats at least 1")
    return args


def out_paths(out: str) -> tuple[Path, Path]:
    path = Path(out)
    if path.is_dir() or out.endswith(os.sep):
        path = path / "latest"
    elif path.suffix in (".json", ".md"):
        path = path.with_suffix("")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_suffix(".json"), path.with_suffix(".md")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    if wrk_path() is None:
        print(MISSING_WRK, file=sys.stderr)
        return 2
    missing = _missing_packages(opts.variant_list)
    if missing:
        print(
            "missing packages: " + "; ".join(missing) + "\ninstall them with: "
            "pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    load = Load(connections=opts.connections, threads=opts.threads, drain=opts.drain)
    command = "python -m bench" + ("" if not argv else " " + shlex.join(argv))
    run_id = secrets.token_hex(3)
    started = time.time()
    runs: list[Run] = []
    roundtrips: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    total = opts.repeats * len(opts.scenario_list) * len(opts.variant_list)
    log(f"{command}: {total} runs of {opts.duration:g} s (+ warm-up, drain and app start)")
    with EmbeddedPostgres() as pg:
        dsns = {
            v: asyncio.run(prepare_database(pg.dsn, database_name(v))) for v in opts.variant_list
        }
        info = report.machine_info(command, load_start=os.getloadavg())
        info["postgres"] = asyncio.run(server_info(pg.dsn))
        info["uvicorn_args"] = " ".join(uvicorn_speedups()) or "(defaults)"
        info["wrk"] = wrk_version()
        n = 0
        for repeat in range(opts.repeats):
            k = repeat % len(opts.variant_list)
            order = opts.variant_list[k:] + opts.variant_list[:k]
            for scenario in opts.scenario_list:
                for variant in order:
                    n += 1
                    try:
                        run = run_one(
                            variant, scenario, repeat, dsns[variant], pg.pid(), opts, load, run_id
                        )
                    except Exception as exc:  # one broken run must not lose the others
                        run = failed_run(repeat, variant, scenario, exc)
                    runs.append(run)
                    log(
                        f"[{n}/{total}] repeat {repeat + 1} {scenario:6} {variant:20} "
                        f"{run.rps:8.1f} req/s p99 {run.p99_ms:7.1f} ms "
                        f"{'ok' if run.correct else 'VIOLATION'}: {run.check} "
                        f"(foreign CPU {run.cpu.get('foreign_cores', 0):.2f} cores)"
                    )
        if opts.roundtrips:
            from . import roundtrips as rt

            log("round trips ...")
            roundtrips = rt.as_json(rt.run(pg.dsn))
        if opts.memory:
            from . import memory as mem

            log("memory ...")
            memory = mem.measure(pg.dsn, mem.DEFAULT_VARIANTS, opts.memory_requests)
    info["load_end"] = list(os.getloadavg())
    info["elapsed_s"] = round(time.time() - started, 1)
    results: dict[str, Any] = {
        "command": command,
        "machine": info,
        "settings": {
            "duration_s": opts.duration,
            "repeats": opts.repeats,
            "connections": opts.connections,
            "wrk_threads": opts.threads,
            "warmup_s": opts.warmup,
            "drain_s": opts.drain,
            "pool_size": opts.pool_size,
            "accounts": ACCOUNTS,
            "replay_keys": load.replay_keys,
            "dup_group": load.dup_group,
            "body": BODY,
            "variants": opts.variant_list,
            "scenarios": opts.scenario_list,
        },
        "runs": [asdict(r) for r in runs],
        "roundtrips": roundtrips,
        "memory": memory,
    }
    results["summary"] = report.summarize(results)
    results["targets"] = report.targets(results)
    markdown = report.markdown(results)
    json_path, md_path = out_paths(opts.out)
    report.write_json(json_path, results)
    md_path.write_text(markdown)
    print(markdown)
    log(f"wrote {json_path} and {md_path} in {info['elapsed_s']:.0f} s")
    return 0
