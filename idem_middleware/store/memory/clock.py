"""The in-memory store's clock: its notion of the database's `now()`, in seconds."""

from __future__ import annotations

import inspect
import math
import numbers
import time
from collections.abc import Callable

#: The most seconds a clock may read (about the year 5138): `time.time()` does, a clock in
#: milliseconds or nanoseconds (`time.time_ns`) does not, and made a day's retention last 86 ms
#: or 86 µs (a retry ran the handler again).
MAX_READING = 1e11


def wall_clock() -> float:
    """`time.time()`, looked up at each call: a clock a test patches (freezegun's) is followed."""
    return time.time()


def checked_clock(clock: Callable[[], float]) -> Callable[[], float]:
    """`MemoryStore(clock=...)`, read once: a plain function answering seconds as a finite real
    number. (`clock=time.time()`, the reading, made every guarded request an empty 500; an async
    clock or `datetime.now` failed each request after its handler ran.)"""
    if not callable(clock) or inspect.iscoroutinefunction(clock):
        raise TypeError(f"MemoryStore(clock=...) is a plain function, not {clock!r:.60}")
    reading = clock()
    real = isinstance(reading, numbers.Real) and not isinstance(reading, bool)
    if not real or not math.isfinite(reading) or abs(reading) >= MAX_READING:
        raise TypeError(
            "MemoryStore(clock=...) answers seconds as a finite number (as time.time() does),"
            f" not the {type(reading).__name__} {reading!r:.60}"
        )
    return clock
