"""How much CPU something other than the benchmark used during a run (other engineers' tests,
say): the machine's busy time minus the app's, our PostgreSQL's and wrk's, in cores."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

import psutil


def _busy_seconds() -> float:
    """Time the CPUs ran processes. Interrupt and softirq time (the loopback traffic's, mostly)
    and time stolen by the hypervisor are left out: no process is billed for them."""
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system)


def _tree_cpu(pids: list[int | None]) -> dict[int, float]:
    out: dict[int, float] = {}
    for pid in pids:
        if pid is None:
            continue
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                c = p.cpu_times()
                out[p.pid] = c.user + c.system
            except psutil.Error:
                pass
    return out


def _children_rusage() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass
class CpuSample:
    wall: float
    busy: float
    ours: dict[int, float]
    children: float


class CpuMeter:
    """Sample before and after a run; `result()["foreign_cores"]` is the CPU nobody of ours used.

    Ours: this process and its children (the app, wrk while it runs, reaped wrk via rusage) and
    the trees of the given pids (our PostgreSQL's postmaster and backends).
    """

    def __init__(self, *pids: int | None) -> None:
        self.pids = [os.getpid(), *pids]
        self.start: CpuSample | None = None
        self.end: CpuSample | None = None

    def _sample(self) -> CpuSample:
        return CpuSample(
            time.monotonic(), _busy_seconds(), _tree_cpu(self.pids), _children_rusage()
        )

    def __enter__(self) -> CpuMeter:
        self.start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = self._sample()

    def result(self) -> dict[str, float]:
        assert self.start is not None
        assert self.end is not None
        a, b = self.start, self.end
        wall = max(b.wall - a.wall, 1e-9)
        ours = sum(v - a.ours.get(pid, 0.0) for pid, v in b.ours.items())
        reaped = b.children - a.children  # wrk, waited for inside the window
        busy = b.busy - a.busy
        foreign = max(0.0, busy - ours - reaped)
        return {
            "busy_cores": round(busy / wall, 2),
            "ours_cores": round((ours + reaped) / wall, 2),
            "foreign_cores": round(foreign / wall, 2),
            "cores": float(os.cpu_count() or 1),
        }
