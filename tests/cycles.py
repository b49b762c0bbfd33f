"""What the cyclic garbage collector would find of the middleware's own, with the collector off.

`gc.collect()`'s count is the whole process's: in a full run, another test's leftovers (a thread
ending, an event loop's last references let go) become garbage while a test runs, and a slow
machine decides when. A request's cycle holds the middleware's objects, or the frames of its
code (every coroutine it awaits in, every traceback through it), so those are what is counted.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_PACKAGE = "idem_middleware"
_SOURCE = "/idem_middleware/"


def _ours(obj: Any) -> bool:
    if isinstance(obj, types.FrameType):
        return _SOURCE in obj.f_code.co_filename
    if isinstance(obj, types.CoroutineType | types.GeneratorType):
        return _SOURCE in obj.__code__.co_filename if hasattr(obj, "__code__") else False
    if isinstance(obj, types.TracebackType):
        return _SOURCE in obj.tb_frame.f_code.co_filename
    if isinstance(obj, types.MethodType):
        return _ours(obj.__self__)
    return (type(obj).__module__ or "").startswith(_PACKAGE)


@dataclass
class Garbage:
    """Filled when the block ends: the garbage found, and the part of it that is ours."""

    found: int = 0
    ours: list[str] = field(default_factory=list)


@contextmanager
def collector_off() -> Iterator[Garbage]:
    """Collects first, runs the block with the collector off, then collects what the block left
    (kept aside with DEBUG_SAVEALL, looked at, and let go)."""
    garbage = Garbage()
    gc.collect()
    gc.disable()
    # What lived before the block is not the block's: another test's middleware, which a timer
    # or a task of that test (ending in this block) held until then, is not a cycle of these
    # requests. (An address freed and used again in the block hides that object: a few of many.)
    before = {id(o) for o in gc.get_objects()}
    debug = gc.get_debug()
    try:
        yield garbage
        gc.set_debug(debug | gc.DEBUG_SAVEALL)
        try:
            garbage.found = gc.collect()
            garbage.ours = sorted(
                repr(type(o)) for o in gc.garbage if id(o) not in before and _ours(o)
            )
        finally:
            gc.set_debug(debug)
            gc.garbage.clear()
    finally:
        gc.enable()
