"""Where an app's CPU goes under load: py-spy samples the uvicorn process while wrk runs.

`python -m bench.profile [--variant ours-tx] [--scenario fresh] [--duration 10] [--top 10]`
prints the functions with the most *own* time (the sampled frame was that function itself) and
their cumulative share; `--svg PATH` also writes py-spy's flame graph (a second run). Needs
py-spy (in the bench extra) and ptrace rights over the app (root, or CAP_SYS_PTRACE).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

from .app import VARIANTS
from .db import EmbeddedPostgres, database_name, prepare_database
from .server import app_server
from .wrk import MISSING_WRK, SCRIPTS, Load, run_wrk, wrk_path

_LINE = re.compile(r"^(.*) (\d+)$")
_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


def _site(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path.replace(str(Path.cwd()) + "/", "")


def _frame(raw: str) -> str:
    m = _FRAME.match(raw)
    if m is None:
        return raw
    return f"{m.group(1)} ({_site(m.group(2))})"


def top_functions(collapsed: str, n: int) -> tuple[int, list[tuple[str, int, int]]]:
    """(samples, [(function, own samples, cumulative samples)]) from py-spy's raw output."""
    own: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        stack, count = m.group(1), int(m.group(2))
        frames = [_frame(f) for f in stack.split(";") if f]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for f in set(frames):
            cumulative[f] += count
    return total, [(f, c, cumulative[f]) for f, c in own.most_common(n)]


def markdown(total: int, rows: list[tuple[str, int, int]]) -> str:
    lines = [
        f"{total} samples of the app's busy time (idle excluded)",
        "",
        "| # | function (file) | own | cumulative |",
        "|---|---|---|---|",
    ]
    for i, (f, own, cum) in enumerate(rows, 1):
        name = f.replace("|", "\\|")
        lines.append(f"| {i} | `{name}` | {own / total:.1%} | {cum / total:.1%} |")
    return "\n".join(lines)


def profile(
    admin_dsn: str, variant: str, scenario: str, duration: float, fmt: str, output: Path
) -> None:
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy (in the bench extra)")
    dsn = asyncio.run(prepare_database(admin_dsn, database_name(variant) + "_profile"))
    load = Load()
    with app_server(variant, dsn, 20) as app:
        run_wrk(app.url, scenario, 1.0, "profile-warm", load)  # warm-up
        record = [
            spy,
            "record",
            "--pid",
            str(app.pid),
            "--duration",
            str(max(1, int(duration))),
            "--rate",
            "200",
            "--nonblocking",
            "--format",
            fmt,
            "--output",
            str(output),
        ]
        spy_proc = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        loader = threading.Thread(
            target=run_wrk, args=(app.url, scenario, duration + 1, "profile", load), daemon=True
        )
        loader.start()
        _, err = spy_proc.communicate(timeout=duration + 60)
        loader.join(duration + 60)
        if spy_proc.returncode != 0:
            raise SystemExit(f"py-spy failed: {err.decode(errors='replace')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--variant", default="ours-tx", choices=VARIANTS)
    parser.add_argument("--scenario", default="fresh", choices=tuple(SCRIPTS))
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--svg", type=Path, help="also write a flame graph here (a second run)")
    parser.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here")
    args = parser.parse_args(argv)
    if wrk_path() is None:
        print(MISSING_WRK, file=sys.stderr)
        return 2
    with EmbeddedPostgres() as pg, tempfile.TemporaryDirectory() as tmp:
        raw = args.raw or Path(tmp) / "profile.txt"
        profile(pg.dsn, args.variant, args.scenario, args.duration, "raw", raw)
        total, rows = top_functions(raw.read_text(), args.top)
        print(f"## {args.variant}, {args.scenario}, {args.duration:g} s\n")
        print(markdown(total, rows))
        if args.svg:
            profile(pg.dsn, args.variant, args.scenario, args.duration, "flamegraph", args.svg)
            print(f"\nflame graph: {args.svg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
