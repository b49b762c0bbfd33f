"""Peak RSS of an app process under 1 MiB request bodies and 1 MiB stored responses.

`python -m bench.memory [--dsn URL] [--requests N] [--variants ...]`: for each variant and each
phase, a fresh `uvicorn` process (the same command line as the load runs) is warmed up with small
requests, then sent N sequential requests of the phase; VmHWM (the kernel's peak RSS) is read from
/proc/<pid>/status before and after. The growth, divided by 1 MiB, is the cost of one such request
in peak memory. Both the growth after the first request (one request's working set) and after
all N are reported: requests are sequential, so memory one frees is there for the next, and
growth beyond the first request is memory the process kept (the C heap not given back).

Phases:
- `body`: POST /accounts/{id}/credits with a 1 MiB JSON body (`memo` pads it to 1 MiB exactly);
- `response`: POST /blobs answering 1 MiB (stored, for ours: the cap is 1 MiB inclusive);
- `replay`: the `response` phase's keys sent again (ours replays the stored 1 MiB; the bare app
  just runs the handler again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from typing import Any

import httpx

from .app import TOKEN
from .db import EmbeddedPostgres, database_name, prepare_database
from .server import app_server, read_status

MIB = 1024 * 1024
PHASES = ("body", "response", "replay")
DEFAULT_VARIANTS = ("bare", "ours-tx", "ours-lease")


def mib_body() -> bytes:
    """A JSON credit whose encoding is exactly 1 MiB."""
    head, tail = b'{"amount": 1, "memo": "', b'"}'
    return head + b"m" * (MIB - len(head) - len(tail)) + tail


def _headers(key: str | None) -> dict[str, str]:
    h = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    if key is not None:
        h["idempotency-key"] = key
    return h


def _check(r: httpx.Response, expect: int) -> None:
    if r.status_code != 201:
        raise RuntimeError(f"expected 201, got {r.status_code}: {r.text[:300]}")
    if expect and len(r.content) != expect:
        raise RuntimeError(f"expected {expect} bytes, got {len(r.content)}")


def _phase(url: str, pid: int, phase: str, n: int) -> dict[str, Any]:
    tag = secrets.token_hex(4)
    with httpx.Client(base_url=url, timeout=60) as c:
        # Warm-up: the same routes with small payloads, so code paths and pools are ready.
        for i in range(20):
            _check(
                c.post(
                    f"/accounts/acc-{i % 10}/credits",
                    content=b'{"amount": 1, "memo": "warm"}',
                    headers=_headers(f"{tag}-w-{i}"),
                ),
                0,
            )
            _check(
                c.post("/blobs", content=b'{"size": 1024}', headers=_headers(f"{tag}-wb-{i}")), 0
            )
        keys = [f"{tag}-{phase}-{i}" for i in range(n)]
        body = mib_body()
        blob = json.dumps({"size": MIB}).encode()

        def send(i: int, key: str) -> None:
            if phase == "body":
                r = c.post(f"/accounts/acc-{i % 10}/credits", content=body, headers=_headers(key))
                _check(r, 0)
            else:
                _check(c.post("/blobs", content=blob, headers=_headers(key)), MIB)

        if phase == "replay":
            for i, key in enumerate(keys):
                send(i, key)  # stored first; the replays below are what is measured
        before = read_status(pid)
        first = before
        for i, key in enumerate(keys):
            send(i, key)
            if i == 0:
                first = read_status(pid)
        after = read_status(pid)
    return {
        "phase": phase,
        "requests": n,
        "hwm_before_mib": round(before["VmHWM"] / MIB, 1),
        "hwm_after_mib": round(after["VmHWM"] / MIB, 1),
        "rss_after_mib": round(after["VmRSS"] / MIB, 1),
        "first_growth_mib": round((first["VmHWM"] - before["VmHWM"]) / MIB, 2),
        "growth_mib": round((after["VmHWM"] - before["VmHWM"]) / MIB, 2),
    }


def measure(admin_dsn: str, variants: tuple[str, ...], n: int, pool_size: int = 20) -> list[Any]:
    results = []
    for variant in variants:
        dsn = asyncio.run(prepare_database(admin_dsn, database_name(variant) + "_mem"))
        for phase in PHASES:
            with app_server(variant, dsn, pool_size) as app:
                row = _phase(app.url, app.pid, phase, n)
            results.append({"variant": variant, **row})
    base = {r["phase"]: r for r in results if r["variant"] == "bare"}
    for r in results:
        b = base.get(r["phase"])
        if r["variant"] != "bare" and b is not None:
            r["first_beyond_bare_mib"] = round(r["first_growth_mib"] - b["first_growth_mib"], 2)
            r["beyond_bare_mib"] = round(r["growth_mib"] - b["growth_mib"], 2)
    return results


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | phase | peak RSS growth after 1 request (x 1 MiB; beyond bare) "
        "| after N requests (x 1 MiB; beyond bare) | N | peak RSS before → after (MiB) |",
        "|---|---|---|---|---|---|",
    ]

    def cell(value: float, beyond: float | None) -> str:
        return f"{value:.2f}" + ("" if beyond is None else f" ({beyond:+.2f})")

    for r in results:
        lines.append(
            f"| {r['variant']} | {r['phase']} "
            f"| {cell(r['first_growth_mib'], r.get('first_beyond_bare_mib'))} "
            f"| {cell(r['growth_mib'], r.get('beyond_bare_mib'))} | {r['requests']} "
            f"| {r['hwm_before_mib']} → {r['hwm_after_mib']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--dsn", help="an admin URL of a PostgreSQL server (default: embedded)")
    parser.add_argument("--requests", type=int, default=20, help="requests per phase")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if args.dsn:
        results = measure(args.dsn, variants, args.requests)
    else:
        with EmbeddedPostgres() as pg:
            results = measure(pg.dsn, variants, args.requests)
    print(json.dumps(results, indent=2) if args.json else markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
