"""jobs.py, pinned against hand-made mutants (mutation18).

- A job function whose signature cannot be read is not checked, and a key named by its
  argument's name is then taken on trust (`_takes_keyword`), not refused when decorated.
- A key argument passed by position (where the function takes it so) is a TypeError that says to
  pass it by keyword, not a bare KeyError naming it.
"""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware import IdempotencyContext, MemoryStore
from idem_middleware.jobs import idempotent_job


class Opaque:
    """An async callable whose signature `inspect` cannot read."""

    __signature__ = "unreadable"

    def __init__(self) -> None:
        self.runs: list[str] = []

    async def __call__(self, job: IdempotencyContext, *, ref: str) -> dict[str, str]:
        self.runs.append(ref)
        return {"ref": ref}


async def test_a_function_whose_signature_cannot_be_read_takes_a_key_by_name() -> None:
    fn = Opaque()
    run = idempotent_job(MemoryStore(), operation="opaque", key="ref")(fn)
    assert await run(ref="r1") == {"ref": "r1"}
    assert await run(ref="r1") == {"ref": "r1"}
    assert fn.runs == ["r1"]


async def test_a_key_argument_passed_by_position_is_a_type_error_saying_so() -> None:
    runs: list[Any] = []

    @idempotent_job(MemoryStore(), operation="positional", key="ref")
    async def send(job: IdempotencyContext, ref: str) -> str:
        runs.append(ref)
        return ref

    with pytest.raises(TypeError, match="pass the idempotency key argument 'ref' by keyword"):
        await send("r1")
    assert runs == []
    assert await send(ref="r1") == "r1"
