"""Python bytecodes per request, counted per function: where the middleware's own work goes.

`python -m bench.opcodes [--requests 300] [--concurrency 32] [--variants bare,ours-memory,ours-tx]
[--gc-requests 3000] [--top 25] [--others 15] [--accounts 100] [--dsn URL]` (`--dsn`: a server
where it may create databases; `--accounts 0`: a new account id in every request's path, so the
middleware's route cache never hits)

Drives the benchmark's apps (`bench.app`: the handler writes to PostgreSQL, bearer
authentication in front) in-process as `bench.cpu` does, fresh keys, `--concurrency` requests in
flight, and counts every bytecode the event loop's thread executes (`sys.settrace` with opcode
events), per function. Unlike a clock, or callgrind's instructions at this concurrency (whose
garbage-collector passes depend on how requests interleave), the counts are the same from run to
run, and they name Python functions, which callgrind cannot on Python 3.11. A bytecode is not a
unit of time (a call into C counts as one), so report them beside `bench.cpu` and
`bench.instructions`, not instead of them.

Prints, per variant: bytecodes per request and over bare, and the garbage collector's passes per
1,000 requests (untraced, in a run of `--gc-requests` of their own: a pass comes every few
dozen requests, and when depends on how they interleave); then the middleware's functions
(`idem_middleware`), the most bytecodes first, the other packages' difference from bare, and
the `--others` functions outside the package (the standard library's, asyncpg's, ...) whose
bytecodes per request differ most from bare's.
A coroutine's "calls" count its resumptions: each await that suspends passes through every
frame between the awaiting code and the task.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from types import FrameType
from typing import Any

from .app import VARIANTS, create_app
from .cpu import drive
from .db import EmbeddedPostgres, database_name, prepare_database

_PACKAGE = str(Path(__file__).resolve().parent.parent / "idem_middleware")
Where = tuple[str, int, str]  # file, first line, function


class Counts:
    """Bytecodes and calls per function, from a trace of the current thread."""

    def __init__(self) -> None:
        self.ops: Counter[Where] = Counter()
        self.calls: Counter[Where] = Counter()

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        where = (code.co_filename, code.co_firstlineno, code.co_name)
        if event == "opcode":
            self.ops[where] += 1
        elif event == "call":
            frame.f_trace_opcodes = True
            self.calls[where] += 1
        return self._trace

    def __enter__(self) -> Counts:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


def package_of(filename: str) -> str:
    """`idem_middleware`, a site-packages distribution's top directory, or the file's name."""
    if filename.startswith(_PACKAGE):
        return "idem_middleware"
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1].split("/", 1)[0]
    if "/lib/python3" in filename:
        return "stdlib"
    return Path(filename).name


def short(where: Where) -> str:
    filename, line, name = where
    return f"{filename.removeprefix(_PACKAGE + '/')}:{line} {name}"


def short_other(where: Where) -> str:
    """A function outside the package, its file named from its package's (or the stdlib's) top."""
    filename, line, name = where
    for marker in ("site-packages/", "/lib/python3"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            if marker != "site-packages/":
                filename = filename.split("/", 1)[1] if "/" in filename else filename
            break
    return f"{filename}:{line} {name}"


async def _count(
    app: Any, requests: int, concurrency: int, gc_requests: int, run: str, accounts: int
) -> tuple[Counts, float]:
    async with app.router.lifespan_context(app):
        await drive(app, min(300, requests), f"{run}-warm", concurrency, accounts)
        # The garbage collector's passes, untraced (tracing changes what is allocated).
        passes: Counter[int] = Counter()

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                passes[info["generation"]] += 1

        gc.callbacks.append(on_gc)
        try:
            await drive(app, gc_requests, f"{run}-gc", concurrency, accounts)
        finally:
            gc.callbacks.remove(on_gc)
        with Counts() as counts:
            await drive(app, requests, f"{run}-counted", concurrency, accounts)
    return counts, sum(passes.values()) * 1000 / gc_requests


async def measure(args: argparse.Namespace, variants: list[str]) -> str:
    results: dict[str, tuple[Counts, float]] = {}
    with nullcontext(args.dsn) if args.dsn else EmbeddedPostgres() as pg:
        dsn = args.dsn or pg.dsn
        for v in variants:
            db = "bare" if v in ("ours-memory", "floor-memory") else v
            app = create_app(v, await prepare_database(dsn, database_name(db) + "_ops"), 20)
            app.state.variant = v
            results[v] = await _count(
                app, args.requests, args.concurrency, args.gc_requests, f"ops-{v}", args.accounts
            )
            print(f"{v}: counted", file=sys.stderr, flush=True)
    return markdown(results, args.requests, args.top, args.others)


def markdown(results: dict[str, tuple[Counts, float]], n: int, top: int, others: int = 0) -> str:
    def total(v: str) -> float:
        return sum(results[v][0].ops.values()) / n

    base = total("bare") if "bare" in results else None
    lines = [
        "| variant | bytecodes per request | + vs bare | GC passes per 1,000 requests |",
        "|---|---|---|---|",
    ]
    for v, (_, gc_passes) in results.items():
        over = "—" if base is None or v == "bare" else f"+{total(v) - base:,.0f}"
        lines.append(f"| {v} | {total(v):,.0f} | {over} | {gc_passes:.0f} |")
    for v, (counts, _) in results.items():
        if v == "bare":
            continue
        ours = [w for w in counts.ops if package_of(w[0]) == "idem_middleware"]
        ours.sort(key=lambda w: -counts.ops[w])
        mine = sum(counts.ops[w] for w in ours) / n
        lines += [
            "",
            f"**{v}**: the middleware's functions, {mine:,.0f} bytecodes per request",
            "",
            "| function | bytecodes per request | calls (resumptions) per request |",
            "|---|---|---|",
        ]
        lines += [
            f"| {short(w)} | {counts.ops[w] / n:,.1f} | {counts.calls[w] / n:.2f} |"
            for w in ours[:top]
        ]
        if len(ours) > top:
            rest = sum(counts.ops[w] for w in ours[top:]) / n
            lines.append(f"| {len(ours) - top} more | {rest:,.1f} | |")
        if "bare" in results:
            lines += [
                "",
                "| other code, by package | bytecodes per request over bare |",
                "|---|---|",
            ]
            by_package: Counter[str] = Counter()
            for w, ops in counts.ops.items():
                by_package[package_of(w[0])] += ops
            for w, ops in results["bare"][0].ops.items():
                by_package[package_of(w[0])] -= ops
            del by_package["idem_middleware"]
            for package, ops in sorted(by_package.items(), key=lambda kv: -abs(kv[1]))[:8]:
                lines.append(f"| {package} | {ops / n:+,.0f} |")
            if others:
                lines += _other_functions(counts, results["bare"][0], n, others)
    return "\n".join(lines)


def _other_functions(counts: Counts, bare: Counts, n: int, others: int) -> list[str]:
    """The functions outside the package whose bytecodes differ most from bare's."""
    ops: Counter[Where] = Counter()
    calls: Counter[Where] = Counter()
    for w in set(counts.ops) | set(bare.ops):
        if package_of(w[0]) != "idem_middleware":
            ops[w] = counts.ops[w] - bare.ops[w]
            calls[w] = counts.calls[w] - bare.calls[w]
    listed = sorted((w for w in ops if ops[w]), key=lambda w: -abs(ops[w]))[:others]
    lines = [
        "",
        "| other function | bytecodes per request over bare | calls per request over bare |",
        "|---|---|---|",
    ]
    lines += [f"| {short_other(w)} | {ops[w] / n:+,.1f} | {calls[w] / n:+.2f} |" for w in listed]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.opcodes", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=300, help="counted requests per variant")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--variants", default="bare,ours-memory,ours-tx", help="comma-separated")
    p.add_argument(
        "--gc-requests", type=int, default=3000, help="untraced requests for the GC's passes"
    )
    p.add_argument("--top", type=int, default=25, help="the middleware's functions listed")
    p.add_argument(
        "--others",
        type=int,
        default=15,
        help="functions outside the package listed by their difference from bare (0: none)",
    )
    p.add_argument(
        "--accounts",
        type=int,
        default=100,
        help="accounts the paths name in turn; 0: a new one in every path (route cache misses)",
    )
    p.add_argument("--dsn", help="a PostgreSQL server to use (default: an embedded one)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if (
        args.requests < 1
        or args.gc_requests < 1
        or args.accounts < 0
        or args.others < 0
        or not variants
        or not set(variants) <= set(VARIANTS)
    ):
        p.error(
            "--requests must be at least 1, --accounts and --others at least 0, and --variants "
            "among " + ", ".join(VARIANTS)
        )
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - the bench extra installs it
        runner = asyncio.run
    print(runner(measure(args, variants)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
