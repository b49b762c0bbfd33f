"""CPU per request, client and server, measured in-process (no HTTP server, no load generator).

`python -m bench.cpu [--requests 4000] [--concurrency 32] [--rounds 3] [--variants ...]`
calls each variant's ASGI app directly with `--concurrency` requests in flight (fresh keys,
uvloop), and reports per request: the app process's CPU time (`time.process_time`), the
PostgreSQL server's (its processes' utime+stime from /proc), and the cyclic garbage collector's
passes. Without uvicorn and wrk sharing the two cores, the differences between variants are
the middleware's own, and they are what the throughput ratios of `python -m bench` come from.

Variants: those of `bench.app`; `bare+memory` is its `ours-memory` (the bare app, its handler on
its own pool, behind IdempotencyMiddleware with a MemoryStore: the middleware's own Python work
with no database statements of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from .app import TOKEN, create_app
from .db import EmbeddedPostgres, database_name, prepare_database

BODY = b'{"amount": 5}'
MEMORY_VARIANT = "bare+memory"
DEFAULT_VARIANTS = ("bare", MEMORY_VARIANT, "ours-tx", "ours-lease")


def server_cpu_seconds() -> float:
    """utime+stime of every PostgreSQL process on this machine (the benchmark's own server)."""
    ticks = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if not stat[stat.index("(") + 1 : stat.rindex(")")].startswith("postgres"):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _scope(path: str, key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Bearer {TOKEN}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
            (b"idempotency-key", key.encode()),
        ],
    }


async def drive(
    app: Any, n: int, prefix: str, concurrency: int, accounts: int = 100
) -> dict[int, int]:
    """n fresh-key credits, `concurrency` at a time; the status codes counted. The paths name
    `accounts` accounts in turn (the benchmark credits 100); 0: a new account in every path, as
    an API whose paths carry fresh ids (no route cache can hold them)."""
    gate = asyncio.Semaphore(concurrency)
    statuses: dict[int, int] = {}

    async def one(i: int) -> None:
        async with gate:
            delivered = False
            client_stays = asyncio.Event()  # never set: the client never leaves
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": BODY, "more_body": False}
                await client_stays.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            account = f"acct-{i % accounts}" if accounts else f"acct-{prefix}-{i}"
            await app(_scope(f"/accounts/{account}/credits", f"{prefix}-{i}"), receive, send)
            status = sent[0]["status"]
            statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return statuses


@dataclass
class Sample:
    variant: str
    client_us: float
    server_us: float
    gc_passes: float
    statuses: dict[int, int]


def _app(variant: str, dsn: str) -> Any:
    app = create_app("ours-memory" if variant == MEMORY_VARIANT else variant, dsn, pool_size=20)
    app.state.variant = variant
    return app


async def measure(
    variants: list[str], requests: int, concurrency: int, rounds: int
) -> list[Sample]:
    samples: list[Sample] = []
    with EmbeddedPostgres() as pg:
        apps = {}
        for v in variants:
            db = "bare" if v == MEMORY_VARIANT else v
            apps[v] = _app(v, await prepare_database(pg.dsn, database_name(db) + "_cpu"))
        for r in range(rounds):
            for v, app in apps.items():
                async with app.router.lifespan_context(app):
                    await drive(app, min(300, requests), f"warm{r}", concurrency)
                    gc_before = sum(s["collections"] for s in gc.get_stats())
                    server_before = server_cpu_seconds()
                    client_before = time.process_time()
                    statuses = await drive(app, requests, f"run{r}", concurrency)
                    client = time.process_time() - client_before
                    server = server_cpu_seconds() - server_before
                    passes = sum(s["collections"] for s in gc.get_stats()) - gc_before
                samples.append(
                    Sample(
                        v,
                        client / requests * 1e6,
                        server / requests * 1e6,
                        passes / requests * 1000,
                        statuses,
                    )
                )
                print(
                    f"round {r + 1} {v:12s} client {samples[-1].client_us:6.0f} us  "
                    f"server {samples[-1].server_us:6.0f} us  {statuses}",
                    file=sys.stderr,
                    flush=True,
                )
    return samples


def markdown(samples: list[Sample], variants: list[str]) -> str:
    lines = [
        "| variant | app CPU per request (median, min-max) | PostgreSQL CPU per request | "
        "GC passes per 1,000 requests | statuses |",
        "|---|---|---|---|---|",
    ]
    for v in variants:
        mine = [s for s in samples if s.variant == v]
        client = [s.client_us for s in mine]
        server = [s.server_us for s in mine]
        statuses: dict[int, int] = {}
        for s in mine:
            for code, n in s.statuses.items():
                statuses[code] = statuses.get(code, 0) + n
        lines.append(
            f"| {v} | {statistics.median(client):,.0f} µs ({min(client):,.0f}-{max(client):,.0f})"
            f" | {statistics.median(server):,.0f} µs"
            f" | {statistics.median(s.gc_passes for s in mine):,.0f} | {statuses} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - the bench extra installs it
        runner = asyncio.run
    samples = runner(measure(variants, args.requests, args.concurrency, args.rounds))
    print(markdown(samples, variants))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
