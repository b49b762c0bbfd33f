"""bench.asgi's stage table: every function it times still exists, and the stages of a fresh
guarded request each see their calls (a target renamed or inlined would leave its stage at zero
and its time in "rest of the middleware", unnoticed but for a note)."""

from __future__ import annotations

import asyncio

from bench import stages as st
from bench.asgi import STAGES, Variant, build_app, make_requests
from idem_middleware import MemoryStore

#: Stages a fresh request with a cached route and an inline body does not pass through.
_NOT_ON_THE_COMMON_PATH = {"route match", "answer"}


def test_every_stage_target_exists_and_the_common_path_reaches_each_stage() -> None:
    rec = st.Recorder(list(STAGES))
    installed, notes = st.install(rec, STAGES)
    try:
        assert notes == []
        variant = Variant("ours-memory", None, 0, 1)
        app = build_app("ours-memory", MemoryStore(), downstream=True)
        send = variant.send()

        async def run() -> None:
            for scope, receive in make_requests("stages", 3):
                await app(scope, receive, send)

        asyncio.run(run())
    finally:
        st.uninstall(installed)
    assert variant.statuses == {201: 3}
    unreached = {s for s in STAGES if rec.calls(s) == 0} - _NOT_ON_THE_COMMON_PATH
    assert unreached == set()
