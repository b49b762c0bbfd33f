"""`python -m example_app.tour` runs to completion and shows what it promises."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from example_app.launcher import ROOT


def test_tour_runs_end_to_end_and_shows_each_fact() -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "BANK_URL"}}
    proc = subprocess.Popen(
        [sys.executable, "-m", "example_app.tour"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the tour stop what it started (its bank, app and PostgreSQL).
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the tour did not finish in 120 s:\n{out}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out

    def section(title: str) -> str:
        start = out.index(f"=== {title}")
        end = out.find("\n=== ", start + 1)
        return out[start : end if end != -1 else None]

    a = section("(a)")
    assert re.search(r"<- 201 Created\n", a)  # the original, without the header
    assert "<- 201 Created  Idempotent-Replayed: true" in a
    # (Python 3.13 names 422 "Unprocessable Content", as RFC 9110 does)
    assert re.search(r"<- 422 Unprocessable (Entity|Content)", section("(b)"))
    assert "key-reused" in section("(b)")
    c = section("(c)")
    # Under a loaded machine a duplicate may give up its 1 s wait with a 409; never a 2nd run.
    burst = re.search(r"statuses \{201: (\d+)(?:, 409: (\d+))?\}; (\d+) of them", c)
    assert burst is not None, c
    ok, conflicts, replayed = int(burst[1]), int(burst[2] or 0), int(burst[3])
    assert (ok + conflicts, replayed) == (20, ok - 1)
    assert '"credits": 1}' in c
    assert "one execution for 20 requests" in c
    d = section("(d)")
    assert "<- 502 Bad Gateway" in d
    assert "<- 201 Created  Idempotent-Replayed: true" in d
    assert "reconciled" in d
    assert "The bank holds 1 transfer" in d
    e = section("(e)")
    assert "SIGKILL" in e
    assert "no response" in e
    assert "<- 201 Created" in e
    assert "reconciled" in e
    f = section("(f)")
    assert "webhook_delay_ms" in f
    assert "SIGKILL to the publisher" in f
    assert "the outbox still has 6 unsent events" in f  # the bank applied one: none marked sent
    assert "outbox publish --url" in f
    assert "--once" in f
    counted = {
        name: int(m[1])
        for name in ("events in the outbox", "deliveries at the bank", "events applied")
        if (m := re.search(rf"{name}\s+(\d+)", f))
    }
    # (a) 1 credit, its replay none; (c) 1 for 20 requests; (d) and (e) a credit and a payout
    # each (the 502 and the crash emitted nothing). The killed publisher's delivery comes on top.
    assert counted == {
        "events in the outbox": 6,
        "deliveries at the bank": 7,
        "events applied": 6,
    }, f
    summary = section("Summary")
    assert re.search(r"\(d\) bank answer lost\s+1\s+1\n", summary)
    assert re.search(r"\(e\) app crashed mid-payout\s+1\s+1\n", summary)
    assert "no money lost, none sent twice" in summary
    assert "Outbox: 6 events, 7 deliveries, 6 applied: each event applied exactly once." in summary
    elapsed = float(re.findall(r"Done in ([\d.]+) s", out)[-1])
    assert elapsed < 60
