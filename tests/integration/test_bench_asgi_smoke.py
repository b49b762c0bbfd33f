"""`python -m bench.asgi --quick` runs end to end and prints a row per variant and per stage (no
timing asserted: the numbers are for docs/performance-asgi.md, not for the tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from bench import stages as st
from bench.asgi import STAGES, VARIANTS

ROOT = Path(__file__).resolve().parents[2]


def _rows(stdout: str) -> dict[str, str]:
    return {
        line.split("|")[1].strip(): line
        for line in stdout.splitlines()
        if line.startswith("|") and line.count("|") >= 5
    }


def _bench(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` in the repository, with `env` added; it must exit 0."""
    out = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_bench_asgi_quick_prints_every_variant_and_every_stage() -> None:
    out = _bench("bench.asgi", "--quick")
    rows = _rows(out.stdout)
    for variant in VARIANTS:
        assert variant in rows, out.stdout
        statuses = rows[variant].rstrip(" |").rsplit("|", 1)[-1].strip()
        assert statuses.startswith("{201: "), rows[variant]  # 201 only: nothing refused
        assert statuses.count(":") == 1, rows[variant]
    for stage in STAGES:
        assert stage in rows, out.stdout
    # The loop request by request (bench/paired.py): 2 rounds x 50 requests per variant.
    assert "bare (100)" in rows, out.stdout
    assert "bare, new paths (100)" in rows, out.stdout
    for paired in ("ours-memory (100)", "floor-memory (100)", "ours-memory, new paths (100)"):
        assert "| 0." in rows[paired] or "| 1." in rows[paired], out.stdout
    assert "Statuses, request by request: {201: 500}" in out.stdout  # every slot's 201s


def test_bench_paired_runs_prints_a_row_per_process_and_their_median() -> None:
    """Each process serves every variant 201s only (it exits non-zero otherwise), and the
    table has a row per process and the summary row."""
    out = _bench("bench.paired_runs", "--processes", "2", "--requests", "30", "--warmup", "5")
    rows = _rows(out.stdout)
    assert set(rows) >= {"1", "2", "**median (range) of the processes**"}, out.stdout
    assert "3" not in rows, out.stdout
    assert rows["1"].count("x / ") == 2, rows["1"]  # ours-memory and the floor
    assert out.stderr.count("(medians)") == 2, out.stderr


def test_a_stage_whose_function_is_gone_is_skipped_with_a_note() -> None:
    """The lead renames internals: a stale (module, attribute) must not break the benchmark."""
    import idem_middleware.keys as keys

    original = keys.parse_idempotency_key
    rec = st.Recorder(["gone", "here"])
    installed, notes = st.install(
        rec,
        {
            "gone": (("idem_middleware.middleware", "no_such_function"),),
            "here": (("idem_middleware.keys", "parse_idempotency_key"),),
        },
    )
    try:
        assert len(notes) == 1, notes
        assert "no_such_function" in notes[0], notes
        assert keys.parse_idempotency_key([(b"idempotency-key", b"k1")]) == "k1"
        assert rec.calls("here") == 1
        assert rec.calls("gone") == 0
    finally:
        st.uninstall(installed)
    assert keys.parse_idempotency_key is original


async def test_bench_instructions_child_serves_every_counted_request_and_the_table_has_the_ratio(
    db_dsn: str,
) -> None:
    """The child `bench.instructions` runs under valgrind serves its requests (201 each, or it
    exits non-zero), here without valgrind, on PostgreSQL too; the table's share is
    (variant - bare) / bare."""
    from bench.instructions import markdown

    for variant in ("bare", "ours-memory", "ours-tx", "ours-lease"):
        run = uuid.uuid4().hex[:8]
        _bench(
            "bench.instructions",
            "--child",
            variant,
            "20",
            run,
            "--counted",
            **{"IDEM_BENCH_DSN": db_dsn},
        )
    table = _rows(markdown({"bare": 400_000.0, "ours-memory": 500_000.0}, 20))
    assert "| +100,000 | 0.25x |" in table["ours-memory"], table


def test_bench_payloads_prints_a_row_per_kind_of_work() -> None:
    """Every kind is timed against the middleware alone, and every request answered 201 (the
    command exits non-zero otherwise)."""
    from bench.payloads import KINDS

    out = _bench("bench.payloads", "--requests", "40", "--units", "3")
    rows = {
        line.split("|")[1].strip(): line
        for line in out.stdout.splitlines()
        if line.startswith("|") and line.count("|") == 4
    }
    assert set(KINDS) <= set(rows), out.stdout
    assert "statuses {201: " in out.stdout, out.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "bench.payloads", "--kinds", "objects,nonsense"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "unknown kinds: nonsense" in refused.stderr


def test_each_payload_does_the_work_it_is_named_for() -> None:
    from bench import payloads

    assert [type(x) for x in payloads._work("objects", 3)()] == [payloads._Plain] * 3
    assert [type(x) for x in payloads._work("frozen", 2)()] == [payloads._Frozen] * 2
    assert [type(x) for x in payloads._work("quick-frozen", 2)()] == [payloads._Quick] * 2
    assert payloads._work("dicts", 2)() == [{"a": i, "b": i, "c": i} for i in range(2)]
    assert payloads._work("calls", 3)() == [1, 2, 3]
    assert payloads._work("functions", 3)() == [1, 2, 3]
    assert len({f.__code__ for f in payloads._DISTINCT[:3]}) == 3  # code objects of their own


def test_bench_routes_prints_a_row_per_layout_and_route_count() -> None:
    """Every app, bare and guarded, in every layout, answers 201 (it exits non-zero otherwise),
    and the router of each layout is the one the middleware walks."""
    out = _bench("bench.routes", "--routes", "0,3", "--requests", "20", "--warmup", "5")
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "x |" in line]
    layouts = [row.split("|")[1].strip() for row in rows]
    assert layouts == [
        f"{n}, {layout}"
        for layout in ("flat", "one router", "five routers", "five routers, each with a prefix")
        for n in (0, 3)
    ], out.stdout
    from bench.routes import build_app

    included = [
        r for r in build_app("five routers", 3, True).router.routes if hasattr(r, "original_router")
    ]
    assert len(included) == 5 or not included  # (a FastAPI that lays included routes out flat)


def test_bench_bodies_prints_a_row_per_body() -> None:
    """Every body is answered 201 bare and guarded (it exits non-zero otherwise), each takes the
    fingerprint's fast path (what the table's figures are about), and no key is sent twice with
    different bodies (a 422 would be timed instead)."""
    out = _bench("bench.bodies", "--requests", "20", "--warmup", "5")
    from bench.bodies import BODIES

    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "x |" in line]
    assert [row.split("|")[1].strip() for row in rows] == list(BODIES), out.stdout
    from idem_middleware.fingerprint_fast import canonical_json_fast

    assert all(canonical_json_fast(body, 10_000) is not None for body in BODIES.values())


def test_bench_removals_prints_each_parts_cost() -> None:
    """The table has a row per part asked for, and every child answered 201 (it exits non-zero
    otherwise)."""
    out = _bench(
        "bench.removals", "--parts", "fingerprint,watch", "--rounds", "1", "--requests", "20"
    )
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "µs" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["fingerprint", "watch"], out.stdout


def test_every_removal_takes_work_out_and_the_middleware_still_answers() -> None:
    """Each part's removal replaces what it names (a renamed attribute would leave the work in
    place and the table would read zero), and with all of them the app still answers 201."""
    script = (
        "import asyncio, json\n"
        "from bench import removals\n"
        "from idem_middleware import exchange, transactional\n"
        "from idem_middleware.fingerprint import Fingerprinter\n"
        "from idem_middleware.tenant import Tenants\n"
        "before = [Fingerprinter.__call__, transactional.Attempt._settle, Tenants.resolve,\n"
        "          exchange.parse_key_value, transactional.claimed_context, transactional._WATCH]\n"
        "for remove in removals.PARTS.values():\n"
        "    remove()\n"
        "after = [Fingerprinter.__call__, transactional.Attempt._settle, Tenants.resolve,\n"
        "         exchange.parse_key_value, transactional.claimed_context, transactional._WATCH]\n"
        "changed = sum(a is not b for a, b in zip(before, after))\n"
        "result = asyncio.run(removals._child(removals.WHOLE, 20, 5))\n"
        "print(json.dumps([changed, len(removals.PARTS), result['statuses']]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    changed, parts, statuses = json.loads(out.stdout.strip().splitlines()[-1])
    assert changed == parts == 6
    assert statuses == {"201": 40}
