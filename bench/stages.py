"""Per-stage self time of a request, for `python -m bench.asgi`.

Timing wrappers are installed (in the benchmark process only, and removed afterwards) around the
functions and methods a stage table names as `(module, attribute)`: a module-level function as
the module that calls it sees it (`idem_middleware.middleware`, `header_map`), a method
as `Class.method`. Each wrapper reads `time.perf_counter_ns` on entry and exit and keeps a stack:
a stage's *self* time is its interval minus the intervals of the wrapped calls inside it, so the
stages of one request add up without counting anything twice, and whatever no stage names stays
with the nearest wrapped caller.

A wrapper costs time of its own: some inside the interval it measures, some outside it (charged to
its caller). Both are measured right before every round, by wrapping an empty function (a plain
one and a coroutine one) and comparing with calling it unwrapped (the least of several repeats),
and subtracted per call. A function that
returns an async context manager (`@asynccontextmanager`) is timed across its `__aenter__` and
`__aexit__` as well as the call.

This is honest only for one request at a time: the driver runs requests one after another, and a
wrapper that finds the stack changed under it (another task ran a wrapped function meanwhile)
marks the measurement `interleaved`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_ns = time.perf_counter_ns
Target = tuple[str, str]


class Recorder:
    """Self time and calls per stage since the last `reset`. `cal[kind]`: the wrapper's own
    cost inside its interval and outside it (charged to its caller), ns per call, as
    `calibrate` last measured it (the wrappers read it on every call)."""

    def __init__(self, stages: Sequence[str]) -> None:
        self.stages = list(stages)
        self.cal = {"sync": [0.0, 0.0], "async": [0.0, 0.0]}
        #: One [self ns, calls] per wrapper, with its stage and kind.
        self.accs: list[tuple[str, str, list[float]]] = []
        self.stack: list[float] = [0.0]
        self.interleaved = False

    def acc(self, stage: str, kind: str) -> list[float]:
        acc = [0.0, 0.0]
        self.accs.append((stage, kind, acc))
        return acc

    def reset(self) -> None:
        for _, _, acc in self.accs:
            acc[0] = acc[1] = 0.0
        self.stack[:] = [0.0]
        self.interleaved = False

    def self_ns(self, stage: str) -> float:
        return sum(acc[0] for s, _, acc in self.accs if s == stage)

    def calls(self, stage: str) -> float:
        return sum(acc[1] for s, _, acc in self.accs if s == stage)

    def overhead_ns(self) -> float:
        """The wrappers' own cost in all the calls recorded since the last reset."""
        return sum(acc[1] * (self.cal[k][0] + self.cal[k][1]) for _, k, acc in self.accs)


def _sync(rec: Recorder, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    stack, ns = rec.stack, _ns
    cal = rec.cal["sync"]
    acc = rec.acc(stage, "sync")

    def timed(*args: Any, **kwargs: Any) -> Any:
        depth = len(stack)
        stack.append(0.0)
        t0 = ns()
        try:
            return fn(*args, **kwargs)
        finally:
            t = ns() - t0
            if len(stack) != depth + 1:
                rec.interleaved = True
            acc[0] += t - stack.pop() - cal[0]
            acc[1] += 1
            stack[-1] += t + cal[1]

    return timed


def _async(rec: Recorder, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    stack, ns = rec.stack, _ns
    cal = rec.cal["async"]
    acc = rec.acc(stage, "async")

    async def timed(*args: Any, **kwargs: Any) -> Any:
        depth = len(stack)
        stack.append(0.0)
        t0 = ns()
        try:
            return await fn(*args, **kwargs)
        finally:
            t = ns() - t0
            if len(stack) != depth + 1:
                rec.interleaved = True
            acc[0] += t - stack.pop() - cal[0]
            acc[1] += 1
            stack[-1] += t + cal[1]

    return timed


def _acm(rec: Recorder, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    create = _sync(rec, stage, fn)

    class Timed:
        __slots__ = ("cm",)

        def __init__(self, cm: Any) -> None:
            self.cm = cm

        async def _enter(self) -> Any:
            return await self.cm.__aenter__()

        async def _exit(self, *exc: Any) -> Any:
            return await self.cm.__aexit__(*exc)

    Timed.__aenter__ = _async(rec, stage, Timed._enter)  # type: ignore[attr-defined]
    Timed.__aexit__ = _async(rec, stage, Timed._exit)  # type: ignore[attr-defined]

    def timed(*args: Any, **kwargs: Any) -> Any:
        return Timed(create(*args, **kwargs))

    return timed


class Downstream:
    """A pass-through put under the middleware in the stage run only: its self time (the app
    below it, less the capture and body replay it calls back into) is the handler stage. (Here,
    not in bench.asgi: `python -m bench.asgi` runs that module as __main__, a second copy.)"""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


@dataclass
class Installed:
    owner: Any
    name: str
    original: Any
    own: bool  # whether `name` was in the owner's own __dict__ (else it was inherited)


def _resolve(target: Target) -> tuple[Any, str, Any]:
    module_name, attribute = target
    owner: Any = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, inspect.getattr_static(owner, name)


def _kind(fn: Any) -> str | None:
    if isinstance(fn, type) or not callable(fn):
        return None
    if inspect.iscoroutinefunction(fn):
        return "async"
    if inspect.isasyncgenfunction(getattr(fn, "__wrapped__", None)):
        return "acm"
    return "sync"


def install(
    rec: Recorder, stages: Mapping[str, Sequence[Target]]
) -> tuple[list[Installed], list[str]]:
    """Wrap every target that exists; returns what to restore, and a note per target that is
    gone or cannot be wrapped."""
    installed: list[Installed] = []
    notes: list[str] = []
    factories = {"sync": _sync, "async": _async, "acm": _acm}
    for stage, targets in stages.items():
        for target in targets:
            where = f"{target[0]}.{target[1]}"
            try:
                owner, name, raw = _resolve(target)
            except (ImportError, AttributeError):
                notes.append(f"{stage}: {where} not found (renamed or removed?): not timed")
                continue
            wrapper_of: Callable[[Any], Any] = lambda f: f  # noqa: E731
            fn = raw
            if isinstance(raw, staticmethod | classmethod):
                wrapper_of, fn = type(raw), raw.__func__
            kind = _kind(fn)
            if kind is None:
                notes.append(f"{stage}: {where} is not a function: not timed")
                continue
            wrapped = factories[kind](rec, stage, fn)
            wrapped.__name__ = getattr(fn, "__name__", name)
            wrapped.__qualname__ = getattr(fn, "__qualname__", name)
            own = name in getattr(owner, "__dict__", {})
            setattr(owner, name, wrapper_of(wrapped))
            installed.append(Installed(owner, name, raw, own))
    return installed, notes


def uninstall(installed: list[Installed]) -> None:
    for item in reversed(installed):
        if item.own:
            setattr(item.owner, item.name, item.original)
        else:
            delattr(item.owner, item.name)
    installed.clear()


def _noop(a: Any, b: Any) -> None:
    return None


async def _anoop(a: Any, b: Any) -> None:
    return None


def _per_call(loop: Callable[[], None], n: int) -> float:
    t0 = _ns()
    loop()
    return (_ns() - t0) / n


async def _aper_call(loop: Callable[[], Any], n: int) -> float:
    t0 = _ns()
    await loop()
    return (_ns() - t0) / n


async def calibrate(rec: Recorder, calls: int = 10_000, repeats: int = 7) -> None:
    """Measure the wrappers' own cost, inside and outside their interval (see the module doc),
    on an empty function of two arguments, plain and coroutine."""
    probe = "(calibration)"
    own = Recorder([probe])
    sync_w, async_w = _sync(own, probe, _noop), _async(own, probe, _anoop)
    rng = range(calls)

    def empty() -> None:
        for _ in rng:
            pass

    def direct() -> None:
        for _ in rng:
            _noop(rng, rng)

    def wrapped() -> None:
        for _ in rng:
            sync_w(rng, rng)

    async def aempty() -> None:
        for _ in rng:
            pass

    async def adirect() -> None:
        for _ in rng:
            await _anoop(rng, rng)

    async def awrapped() -> None:
        for _ in rng:
            await async_w(rng, rng)

    # The least of several repeats of each loop: the cost itself, with the least interference
    # from other processes (as timeit reports).
    m: dict[str, float] = {}
    for _ in range(repeats):
        own.reset()
        runs = {"e": _per_call(empty, calls), "d": _per_call(direct, calls)}
        runs["w"] = _per_call(wrapped, calls)
        runs["r"] = own.self_ns(probe) / calls
        own.reset()
        runs["ae"] = await _aper_call(aempty, calls)
        runs["ad"] = await _aper_call(adirect, calls)
        runs["aw"] = await _aper_call(awrapped, calls)
        runs["ar"] = own.self_ns(probe) / calls
        m = {k: min(v, m.get(k, v)) for k, v in runs.items()}
        await asyncio.sleep(0)
    for kind, p in (("sync", ""), ("async", "a")):
        # Inside the interval: what was recorded, less calling the empty function itself.
        inner = m[p + "r"] - (m[p + "d"] - m[p + "e"])
        rec.cal[kind][:] = [inner, (m[p + "w"] - m[p + "d"]) - inner]
