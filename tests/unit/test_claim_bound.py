"""A lease-mode claim run to its end under a bound (`closing.Executions`): one that ends in the
turn its bound runs out is its own answer, kept, not a bare TimeoutError with the claim given
back (found by review); one still running when the bound runs out is a StoreError (a 503), and
given back once it lands."""

from __future__ import annotations

import asyncio

import pytest

from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.postgres.closing import Executions

pytestmark = pytest.mark.asyncio
KEY = RecordKey("t", "POST /x", "k")


def _executions(released: list[int]) -> Executions:
    async def release(key: RecordKey, generation: int) -> bool:
        released.append(generation)
        return True

    async def run(*args: object) -> None:  # pragma: no cover - no takeover here
        return None

    return Executions(release, run)


async def test_a_claim_ending_in_the_turn_its_bound_runs_out_is_its_own_answer() -> None:
    released: list[int] = []

    async def claiming() -> Claimed:  # (lands at once: the same turn as a bound of 0 s)
        return Claimed(7, 7)

    assert await _executions(released).claim(claiming(), KEY, 0.0) == Claimed(7, 7)
    await asyncio.sleep(0.05)
    assert released == []  # kept: its request runs it


async def test_a_claim_landing_after_its_bound_is_a_store_error_and_given_back() -> None:
    released: list[int] = []
    landing = asyncio.Event()

    async def claiming() -> Claimed:
        await landing.wait()
        return Claimed(8, 8)

    with pytest.raises(StoreError, match=r"did not answer in 0\.05 s"):
        await _executions(released).claim(claiming(), KEY, 0.05)
    landing.set()
    for _ in range(100):
        if released:
            break
        await asyncio.sleep(0.01)
    assert released == [8]
