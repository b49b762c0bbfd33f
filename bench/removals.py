"""What each part of the middleware costs in place: the part's work taken out, the rest timed.

`python -m bench.removals [--parts fingerprint,settle,...] [--rounds 3] [--requests 6000]`

A stage timed inside a wrapper (`bench.asgi`) or in a loop of its own (`bench.fingerprint`)
misprices it: between FastAPI's own work, what a request pays for is first the code and data it
touches, cold (the fingerprint of a 13-byte body: 2.5-3 µs in a loop, 8 µs in place). Here the
`MemoryStore` middleware runs as it does in `bench.asgi`'s request-by-request loop, with one part's
work replaced by a constant (which breaks the middleware: a measurement, nothing more), in a
process of its own; the part's cost in place is what the middleware adds to bare FastAPI with it
minus without it. Each round runs every part's process and, between them, the whole
middleware's, so the drift of a shared machine moves both; the table gives medians over rounds.
A part whose removal changes nothing reads within about ±0.7 µs of zero.

The parts (each still called, its work gone):
- `fingerprint`: `Fingerprinter.__call__` returns a constant digest;
- `settle`: the attempt's `_settle` records nothing;
- `tenant`: `Tenants.resolve` returns a constant tenant;
- `key`: the key's value is decoded, not parsed;
- `context`: `claimed_context` returns one context made beforehand;
- `watch`: the client watch's registration does nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from idem_middleware import MemoryStore

from .asgi import build_app
from .paired import loop_runner
from .paired_runs import warmed_and_paired

ROOT = Path(__file__).resolve().parents[1]
WHOLE = "none"


async def _nothing() -> None:
    return None


class _NoWatch:
    def add(self, item: Any) -> float:
        return 0.0

    def discard(self, item: Any) -> None:
        return None


def _remove_fingerprint() -> None:
    from idem_middleware.fingerprint import Fingerprinter

    digest = bytes(32)
    Fingerprinter.__call__ = lambda self, query, headers, content_type, body: digest  # type: ignore[method-assign,assignment,misc]


def _remove_settle() -> None:
    from idem_middleware.transactional import Attempt

    Attempt._settle = lambda self, omitted=None, checked=False: _nothing()  # type: ignore[method-assign,assignment,misc]


def _remove_tenant() -> None:
    from idem_middleware.tenant import Tenants

    Tenants.resolve = lambda self, scope, allow_anonymous=False: "tenant"  # type: ignore[method-assign,assignment,misc]


def _remove_key() -> None:
    from idem_middleware import exchange

    exchange.parse_key_value = bytes.decode  # type: ignore[assignment]


def _remove_context() -> None:
    from idem_middleware import transactional
    from idem_middleware.context import claimed_context
    from idem_middleware.policy import Mode

    made = claimed_context("tenant", "operation", "key", 1, Mode.TRANSACTIONAL, None, 1)
    transactional.claimed_context = lambda *args: made  # type: ignore[assignment]


def _remove_watch() -> None:
    from idem_middleware import transactional

    transactional._WATCH = _NoWatch()  # type: ignore[assignment]


PARTS: dict[str, Callable[[], None]] = {
    "fingerprint": _remove_fingerprint,
    "settle": _remove_settle,
    "tenant": _remove_tenant,
    "key": _remove_key,
    "context": _remove_context,
    "watch": _remove_watch,
}


async def _child(part: str, requests: int, warmup: int) -> dict[str, Any]:
    """One process: bare and the middleware (without `part`'s work) taking turns."""
    if part != WHOLE:
        PARTS[part]()
    apps = {"bare": build_app("bare"), "ours": build_app("ours-memory", MemoryStore())}
    times, statuses = await warmed_and_paired(apps, requests, warmup)
    bare, ours = (statistics.median(times[name]) for name in apps)
    return {"bare": bare, "added": ours - bare, "statuses": statuses}


def _run_child(part: str, requests: int, warmup: int) -> dict[str, Any]:
    command = ["--child", part, "--requests", str(requests), "--warmup", str(warmup)]
    out = subprocess.run(
        [sys.executable, "-m", "bench.removals", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if set(result["statuses"]) != {"201"}:  # (JSON keys are text)
        raise SystemExit(f"{part}: not every request was answered 201: {result['statuses']}")
    return result


def measure(parts: list[str], rounds: int, requests: int, warmup: int) -> dict[str, list[float]]:
    """Per part (and `WHOLE`), what the middleware added in each round, µs."""
    added: dict[str, list[float]] = {name: [] for name in [WHOLE, *parts]}
    for _ in range(rounds):
        for part in parts:
            # The whole middleware's process before each part's: the drift moves both alike.
            added[WHOLE].append(_run_child(WHOLE, requests, warmup)["added"])
            added[part].append(_run_child(part, requests, warmup)["added"])
    return added


def markdown(added: dict[str, list[float]]) -> str:
    whole = statistics.median(added[WHOLE])
    lines = [
        f"The whole middleware adds {whole:+.1f} µs (median of {len(added[WHOLE])} processes, "
        f"{min(added[WHOLE]):+.1f} to {max(added[WHOLE]):+.1f}).",
        "",
        "| part | added without its work, µs (median, min-max) | its cost in place, µs |",
        "|---|---|---|",
    ]
    for part, values in added.items():
        if part == WHOLE:
            continue
        median = statistics.median(values)
        lines.append(
            f"| {part} | {median:+.1f} ({min(values):+.1f} to {max(values):+.1f}) "
            f"| {whole - median:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.removals", description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    p.add_argument("--rounds", type=int, default=3, help="processes per part")
    p.add_argument("--requests", type=int, default=6000, help="requests per app and process")
    p.add_argument("--warmup", type=int, default=300, help="unmeasured requests per app")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    runner = loop_runner()
    if args.child is not None:
        print(json.dumps(runner(_child(args.child, args.requests, args.warmup))))
        return 0
    parts = [part for part in args.parts.split(",") if part]
    if unknown := sorted(set(parts) - set(PARTS)):
        p.error(f"unknown parts: {', '.join(unknown)} (known: {', '.join(PARTS)})")
    print(markdown(measure(parts, args.rounds, args.requests, args.warmup)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
