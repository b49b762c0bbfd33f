"""The direct-ASGI loop counted in CPU instructions instead of seconds.

`python -m bench.instructions [--requests 1000] [--variants bare,ours-memory,ours-tx,ours-lease]
[--new-paths]` (`--new-paths`: each request to a path of its own, as `bench.asgi`'s second table)

The same apps and requests as `bench.asgi` (FastAPI, a pydantic body, a JSON response, bearer
authentication; fresh keys), each variant run twice under valgrind's callgrind: once with no
measured request and once with `--requests`. `ours-tx` and `ours-lease` run on PostgreSQL (an
embedded server, outside valgrind, unless `--dsn` names one): their count is the app process's
work per request, the store's client side included, not the server's. The difference, divided
by the requests, is the instructions one request executes, start-up and warm-up cancelled out.
Unlike a clock on a shared virtual machine (where one variant's rounds spread 20-40%), a count is
the same from run to run, so a cut of a few percent is visible at once. It counts work, not
time: a cache miss costs no instruction, and C code that does much per instruction
(pydantic-core, orjson, OpenSSL) weighs less than its time. Report it beside the clock, not
instead of it.

Needs valgrind (`apt-get install valgrind`); about a minute per run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = ("bare", "ours-memory", "ours-tx", "ours-lease")
_DSN = "IDEM_BENCH_DSN"  # the children's database, for the PostgreSQL variants
_COLLECTED = re.compile(r"Collected : (\d+)")
_WARMUP = 200


async def _serve(variant: str, requests: int, counted: bool, run: str, new_paths: bool) -> None:
    import uvloop  # noqa: F401 - the loop bench.asgi runs on

    from idem_middleware import MemoryStore, PostgresStore

    from .asgi import POSTGRES, Variant, build_app, make_requests

    store: Any = None
    if variant in POSTGRES:
        store = await PostgresStore(
            dsn=os.environ[_DSN], min_size=2, max_size=2, listen=False
        ).open()
    elif variant != "bare":
        store = MemoryStore()
    app = build_app(variant, store)
    v = Variant(variant, app, requests, 1)
    send = v.send()
    # Keys of the same length in every run, and fresh in every run of one database.
    for scope, receive in make_requests(f"{run}-warm", _WARMUP, new_paths):
        await app(scope, receive, send)
    todo = make_requests(f"{run}-counted", requests, new_paths)  # built whether counted or not
    gc.collect()
    gc.freeze()
    for scope, receive in todo[: requests if counted else 0]:
        await app(scope, receive, send)
    if isinstance(store, PostgresStore):
        await store.close()
    if counted and v.statuses != {201: _WARMUP + requests}:
        raise SystemExit(f"{variant}: unexpected statuses {dict(v.statuses)}")


def count(variant: str, requests: int, counted: bool, new_paths: bool = False) -> int:
    """Instructions of one child process serving `requests` (counted or only built)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={Path(tmp) / 'out'}",
            sys.executable,
            "-m",
            "bench.instructions",
            "--child",
            variant,
            str(requests),
            os.urandom(4).hex(),
        ]
        if counted:
            argv.append("--counted")
        if new_paths:
            argv.append("--new-paths")
        # A fixed hash seed: dictionaries probe the same way in every run.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"callgrind failed for {variant}:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def per_request(variant: str, requests: int, new_paths: bool = False) -> float:
    counted = count(variant, requests, True, new_paths)
    return (counted - count(variant, requests, False, new_paths)) / requests


def markdown(results: dict[str, float], requests: int, new_paths: bool = False) -> str:
    bare = results.get("bare")
    lines = [
        f"- command: python -m bench.instructions --requests {requests}"
        + (" --new-paths" if new_paths else ""),
        f"- python: {sys.version.split()[0]}",
        "",
        "| variant | instructions per request | + vs bare | + as a share of bare |",
        "|---|---|---|---|",
    ]
    for name, value in results.items():
        extra = "—" if bare is None or name == "bare" else f"+{value - bare:,.0f}"
        share = "—" if bare is None or name == "bare" else f"{(value - bare) / bare:.2f}x"
        lines.append(f"| {name} | {value:,.0f} | {extra} | {share} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        runner: Any
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:  # pragma: no cover - the bench extra installs it
            runner = asyncio.run
        flags = argv[4:]
        runner(_serve(argv[1], int(argv[2]), "--counted" in flags, argv[3], "--new-paths" in flags))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    p.add_argument("--requests", type=int, default=1000, help="counted requests per variant")
    p.add_argument("--variants", default="bare,ours-memory", help="comma-separated")
    p.add_argument("--dsn", help="an admin URL of a PostgreSQL server (default: embedded)")
    p.add_argument("--new-paths", action="store_true", help="each request to a path of its own")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if args.requests < 1 or not variants or not set(variants) <= set(VARIANTS):
        p.error(f"--requests must be at least 1 and --variants among {', '.join(VARIANTS)}")
    if shutil.which("valgrind") is None:
        p.error("valgrind is not installed (apt-get install valgrind)")
    server = None
    if set(variants) & {"ours-tx", "ours-lease"}:
        from .asgi import _postgres

        args.no_postgres = False
        server = _postgres(args)  # migrates a database; starts an embedded server if no --dsn
        os.environ[_DSN] = asyncio.run(server.__aenter__()) or ""
    try:
        results = {v: per_request(v, args.requests, args.new_paths) for v in variants}
        print(markdown(results, args.requests, args.new_paths))
    finally:
        if server is not None:
            asyncio.run(server.__aexit__(None, None, None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
