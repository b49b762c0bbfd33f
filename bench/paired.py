"""The direct-ASGI loop, request by request: the variants take turns one request at a time.

`bench.asgi`'s rounds time batches of one variant. On a machine whose speed drifts by a third
within seconds (ours does: the same bare request read 124 and 210 µs in two runs), a batch of
bare and a batch of the middleware can run at different speeds, and their difference moves by
more than the middleware costs. Here every request is timed alone, and the variants take turns
request by request, in an order that rotates so that none always follows the same one: a drift
hits every variant alike. Two copies of the same app measured this way differ by a few tenths of
a µs.

The mean counts everything, the garbage collector's passes included (the middleware's objects
bring them on more often); the median is a request without one. Both are printed.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope, Send

#: Makes `n` requests (scope and receive) whose keys start with a prefix.
Maker = Callable[[str, int], list[tuple[Scope, Receive]]]
#: Requests made (not timed) at a time, per variant.
_CHUNK = 200


def loop_runner() -> Callable[[Any], Any]:
    """What runs a benchmark's coroutine: uvloop's `run` (the loop the benchmarks' servers use),
    or asyncio's where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the bench extra
        return asyncio.run
    runner: Callable[[Any], Any] = uvloop.run
    return runner


async def measure_paired(
    apps: dict[str, Any],
    requests: int,
    send: Send,
    make_requests: Maker | dict[str, Maker],
) -> dict[str, list[float]]:
    """µs of each of `requests` requests per app, the apps taking turns request by request
    (`make_requests`: one maker for all, or one per app's name)."""
    names = list(apps)
    makers = make_requests
    if not isinstance(makers, dict):
        makers = dict.fromkeys(names, makers)
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    gc.collect()
    done = 0
    while done < requests:
        n = min(_CHUNK, requests - done)
        todo = {name: makers[name](f"p{done}-{slot}", n) for slot, name in enumerate(names)}
        for i in range(n):
            k = (done + i) % len(names)
            for name in names[k:] + names[:k]:
                scope, receive = todo[name][i]
                app = apps[name]
                t0 = clock()
                await app(scope, receive, send)
                times[name].append((clock() - t0) / 1000)
        done += n
    return times


def paired_markdown(
    times: dict[str, list[float]], bare: str = "bare", names: list[str] | None = None
) -> str:
    """A row per variant (of `names`, default all): median and mean µs per request, and what it
    adds to `bare`'s."""
    base_median = statistics.median(times[bare])
    base_mean = statistics.fmean(times[bare])
    lines = [
        "| variant (request by request) | median µs | mean µs | + µs over bare: median / mean "
        "| added, x bare: median / mean |",
        "|---|---|---|---|---|",
    ]
    for name in names or list(times):
        values = times[name]
        median, mean = statistics.median(values), statistics.fmean(values)
        added = (median - base_median) / base_median, (mean - base_mean) / base_mean
        if name == bare:
            lines.append(f"| {name} ({len(values)}) | {median:,.1f} | {mean:,.1f} | — | — |")
            continue
        lines.append(
            f"| {name} ({len(values)}) | {median:,.1f} | {mean:,.1f} "
            f"| {median - base_median:+,.1f} / {mean - base_mean:+,.1f} "
            f"| {added[0]:.2f}x / {added[1]:.2f}x |"
        )
    return "\n".join(lines)
