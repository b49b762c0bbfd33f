"""What the clock charges for each kind of per-request work, in place.

`python -m bench.payloads [--requests 8000] [--units 20] [--kinds calls,objects,...]`

Counted in instructions, the middleware's bytecodes are most of its cost; timed, they are not.
This puts `--units` more of one kind of work (a call, an object built, an await, a dict...) in
front of every request of the `MemoryStore` middleware (the benchmark's app), and times those
requests request by request against the same app without it (bench/paired.py: the variants take
turns, so the machine's drift hits all alike). What each kind adds, per unit, says which of the
middleware's per-request work is worth cutting: on our machine an object built per request cost
several times a call, and a frozen dataclass more than two plain ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from idem_middleware import MemoryStore
from idem_middleware.frozen import quick_init

from .asgi import Variant, build_app, make_requests
from .paired import measure_paired

NONE = "none"


class _Plain:
    __slots__ = ("a", "b", "c", "d")

    def __init__(self, a: int, b: int, c: int, d: int) -> None:
        self.a, self.b, self.c, self.d = a, b, c, d


@dataclasses.dataclass(frozen=True, slots=True)
class _Frozen:
    a: int
    b: int
    c: int
    d: int


@quick_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Quick:
    a: int
    b: int
    c: int
    d: int


def _one(x: int) -> int:
    return x + 1


#: As many distinct (identical) functions as any run asks for: code objects of their own.
_DISTINCT: list[Callable[[int], int]] = []
for _i in range(256):
    _namespace: dict[str, Any] = {}
    exec(f"def f{_i}(x):\n    return x + 1\n", _namespace)
    _DISTINCT.append(_namespace[f"f{_i}"])


async def _nothing(x: int) -> int:
    return x


def _work(kind: str, units: int) -> Callable[[], Any]:
    """`units` of one kind of work, as one synchronous call (awaits: a coroutine to await)."""
    distinct = _DISTINCT[:units]
    kinds: dict[str, Callable[[], Any]] = {
        "calls": lambda: [_one(i) for i in range(units)],
        "functions": lambda: [f(i) for i, f in enumerate(distinct)],
        "objects": lambda: [_Plain(i, i, i, i) for i in range(units)],
        "frozen": lambda: [_Frozen(i, i, i, i) for i in range(units)],
        "quick-frozen": lambda: [_Quick(i, i, i, i) for i in range(units)],
        "dicts": lambda: [{"a": i, "b": i, "c": i} for i in range(units)],
        "young-gc": lambda: gc.collect(0),
    }
    return kinds[kind]


KINDS = ("calls", "functions", "awaits", "objects", "frozen", "quick-frozen", "dicts", "young-gc")


class Payload:
    """The app, with `units` of `kind` of work done in the request's task before it."""

    def __init__(self, app: Any, kind: str, units: int) -> None:
        self.app, self.kind, self.units = app, kind, units
        self.work = None if kind == "awaits" else _work(kind, units)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.work is None:
            for i in range(self.units):
                await _nothing(i)
        else:
            self.work()
        await self.app(scope, receive, send)


def markdown(times: dict[str, list[float]], units: int) -> str:
    base_median, base_mean = statistics.median(times[NONE]), statistics.fmean(times[NONE])
    lines = [
        f"| work before each request ({units} units; young-gc: one) | + µs: median / mean "
        "| per unit, ns: median / mean |",
        "|---|---|---|",
        f"| none (the `MemoryStore` middleware: {base_median:,.1f} / {base_mean:,.1f} µs) "
        "| — | — |",
    ]
    for name, values in times.items():
        if name == NONE:
            continue
        added = statistics.median(values) - base_median, statistics.fmean(values) - base_mean
        per = 1 if name == "young-gc" else units
        lines.append(
            f"| {name} | {added[0]:+.2f} / {added[1]:+.2f} "
            f"| {added[0] * 1000 / per:+,.0f} / {added[1] * 1000 / per:+,.0f} |"
        )
    return "\n".join(lines)


async def run(requests: int, units: int, kinds: list[str]) -> tuple[str, dict[int, int]]:
    app = build_app("ours-memory", MemoryStore())
    apps = {NONE: app, **{kind: Payload(app, kind, units) for kind in kinds}}
    counted = Variant("payloads", None, 0, 1)  # (bench.asgi's: its send counts the statuses)
    send = counted.send()
    for scope, receive in make_requests("warm", 500):
        await app(scope, receive, send)
    gc.collect()
    gc.freeze()
    times = await measure_paired(apps, requests, send, make_requests)
    return markdown(times, units), dict(counted.statuses)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.payloads", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=8000, help="timed requests per variant")
    p.add_argument("--units", type=int, default=20, help="units of work per request (max 256)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"unknown kinds: {', '.join(unknown)}")
    if args.requests < 1 or not 1 <= args.units <= len(_DISTINCT):
        p.error(f"--requests must be at least 1, --units between 1 and {len(_DISTINCT)}")
    import uvloop

    table, statuses = uvloop.run(run(args.requests, args.units, kinds))
    if set(statuses) != {201}:
        raise SystemExit(f"unexpected statuses {statuses}")
    print(f"- command: python -m bench.payloads {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"- {args.requests} timed requests per variant, statuses {statuses}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
