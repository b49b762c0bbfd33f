"""Turn an evidence run (tests/.evidence/<run>.jsonl) into the Markdown table of docs/evidence.md.

    python scripts/evidence_table.py                  # the newest run, printed
    python scripts/evidence_table.py --run default --write

Each line of a run is one scenario's counts (tests/evidence.py). The table sums them per scenario
and says how many times each ran; its caption names the run, its date, the git commit and the
pytest command that produced it. `--write` replaces the block between
`<!-- evidence:start -->` and `<!-- evidence:end -->` in docs/evidence.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE_DIR = ROOT / "tests" / ".evidence"
DOC = ROOT / "docs" / "evidence.md"
START = "<!-- evidence:start -->"
END = "<!-- evidence:end -->"
COUNTS = ("requests", "duplicate_effects", "lost_outcomes", "stuck_keys")

#: What a scenario name means, by its prefix (the part before "/"); others are left blank.
DESCRIPTIONS = {
    "storm": "200 concurrent requests on one key, `--workers 4`",
    "sigkill": "app process group SIGKILLed under load, restarted",
    "pg-restart": "PostgreSQL `-m immediate` restart under load",
    "disconnect-at-every-await": "client disconnects at each await point",
    "cancel-at-every-await": "request task cancelled at each await point",
    "drop-at-every-await": "database connection terminated at each await point",
    "reset-after-commit": "connection reset after COMMIT, before the answer is read",
}


@dataclass
class Row:
    scenario: str
    runs: int = 0
    counts: Counter[str] = field(default_factory=Counter)


def newest_run(directory: Path) -> str:
    files = sorted(directory.glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no evidence in {directory}: run the tests first")
    return files[-1].stem


def load(
    path: Path, since: datetime | None = None, until: datetime | None = None
) -> list[dict[str, Any]]:
    if not path.exists():
        raise SystemExit(f"{path} does not exist")
    lines = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{number}: not JSON ({exc})") from None
        when = _when(line)
        if when is not None and (
            (since is not None and when < since) or (until is not None and when > until)
        ):
            continue
        lines.append(line)
    return lines


def _when(line: dict[str, Any]) -> datetime | None:
    stamp = line.get("recorded_at") or line.get("at")
    return datetime.fromisoformat(stamp) if stamp else None


def aggregate(lines: list[dict[str, Any]]) -> list[Row]:
    rows: dict[str, Row] = {}
    for line in lines:
        row = rows.setdefault(line["scenario"], Row(line["scenario"]))
        row.runs += 1
        for name in COUNTS:
            row.counts[name] += int(line.get(name, 0))
    return list(rows.values())


def git_commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False, timeout=30
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return f"{commit} + uncommitted changes" if git("status", "--porcelain") else commit


def command_of(lines: list[dict[str, Any]]) -> str | None:
    commands = Counter(
        line["details"]["command"]
        for line in lines
        if isinstance(line.get("details"), dict) and line["details"].get("command")
    )
    return commands.most_common(1)[0][0] if commands else None


def describe(scenario: str) -> str:
    prefix, _, mode = scenario.partition("/")
    text = DESCRIPTIONS.get(prefix)
    if text is None:
        return ""
    return f"{text} ({mode})" if mode else text


def render(run: str, lines: list[dict[str, Any]], command: str | None) -> str:
    rows = aggregate(lines)
    stamps = [w for w in map(_when, lines) if w is not None]
    date = max(stamps).strftime("%Y-%m-%d %H:%M UTC") if stamps else "unknown date"
    command = command or command_of(lines) or "python -m pytest"
    total = Counter[str]()
    for row in rows:
        total += row.counts
    out = [
        f"Run `{run}`, {date}, commit `{git_commit()}`: `{command}`. "
        f"{len(lines)} evidence lines; counts are summed over the runs of each scenario.",
        "",
        "| scenario | what | runs | requests | duplicate effects | lost outcomes | stuck keys |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        c = row.counts
        out.append(
            f"| `{row.scenario}` | {describe(row.scenario)} | {row.runs} | {c['requests']} "
            f"| {c['duplicate_effects']} | {c['lost_outcomes']} | {c['stuck_keys']} |"
        )
    out.append(
        f"| **total** | | {sum(r.runs for r in rows)} | {total['requests']} "
        f"| {total['duplicate_effects']} | {total['lost_outcomes']} | {total['stuck_keys']} |"
    )
    return "\n".join(out)


def write_doc(table: str, doc: Path = DOC) -> None:
    text = doc.read_text(encoding="utf-8")
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{doc} has no {START} ... {END} block")
    updated = text[: start + len(START)] + "\n" + table + "\n" + text[end:]
    doc.write_text(updated, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="the run name (default: the newest file in tests/.evidence)")
    parser.add_argument("--dir", type=Path, default=EVIDENCE_DIR, help="where the runs are")
    parser.add_argument(
        "--since",
        type=datetime.fromisoformat,
        help="only lines recorded at or after this time (ISO 8601, with a zone)",
    )
    parser.add_argument(
        "--until",
        type=datetime.fromisoformat,
        help="only lines recorded at or before this time (other sessions may share a run file)",
    )
    parser.add_argument("--command", help="the pytest command to name in the caption")
    parser.add_argument(
        "--write", action="store_true", help="replace the table in docs/evidence.md"
    )
    args = parser.parse_args(argv)
    run = args.run or newest_run(args.dir)
    lines = load(args.dir / f"{run}.jsonl", args.since, args.until)
    if not lines:
        raise SystemExit(f"run {run!r} has no evidence lines")
    table = render(run, lines, args.command)
    if args.write:
        write_doc(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
