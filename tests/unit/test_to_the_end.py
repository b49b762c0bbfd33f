"""`resettle.to_the_end`: a cleanup that must finish (a fenced transaction's rollback, then an
`unknown` mark) runs to its end through further cancellations of its caller, and of its own
task (`asyncio.run` cancels every task left at its exit), then the cancellation goes on, over
an error of the cleanup's too."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from idem_middleware.resettle import to_the_end


async def _until(predicate: object, what: str) -> None:
    for _ in range(500):
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


async def test_the_steps_run_in_turn_and_the_last_ones_answer_is_returned() -> None:
    ran: list[str] = []

    async def step(name: str) -> str:
        ran.append(name)
        return name

    assert await to_the_end(lambda: step("close"), lambda: step("mark")) == "mark"
    assert ran == ["close", "mark"]


async def test_a_second_cancellation_waits_for_the_cleanup_then_goes_on() -> None:
    gate, done = asyncio.Event(), []

    async def mark() -> None:
        await gate.wait()
        done.append("marked")

    cleanup = asyncio.ensure_future(to_the_end(mark))
    await asyncio.sleep(0)
    cleanup.cancel()
    await asyncio.sleep(0.01)
    cleanup.cancel()  # (again)
    await asyncio.sleep(0.01)
    assert not cleanup.done()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await cleanup
    assert done == ["marked"]


async def test_a_step_its_own_task_cancelled_starts_again() -> None:
    """As `asyncio.run` at its exit: every task left is cancelled, the cleanup's own too."""
    gate, started, done = asyncio.Event(), [], []

    async def mark() -> None:
        started.append(1)
        await gate.wait()
        done.append("marked")

    this = asyncio.current_task()
    cleanup = asyncio.ensure_future(to_the_end(mark))
    await _until(lambda: started, "the mark started")
    for task in asyncio.all_tasks():
        if task is not this:
            task.cancel()
    await _until(lambda: len(started) == 2, "the mark started again")
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await cleanup
    assert done == ["marked"]


async def test_a_cancellation_goes_on_over_the_cleanups_error() -> None:
    """An `asyncio.timeout` around the caller expired while the mark was in flight, and the mark
    then failed: the timeout's cancellation goes on (the timeout raises TimeoutError), the mark's
    error chained to it; it was lost, and the timeout never fired."""
    gate = asyncio.Event()

    async def mark() -> None:
        await gate.wait()
        raise LookupError("the database refused the mark")

    async def caller() -> None:
        async with asyncio.timeout(0.01):
            await to_the_end(mark)

    calling = asyncio.ensure_future(caller())
    await asyncio.sleep(0.05)  # (past the timeout: cancelled, waiting for the mark)
    gate.set()
    with pytest.raises(TimeoutError) as raised:
        await calling
    assert isinstance(raised.value.__cause__, asyncio.CancelledError)
    assert isinstance(raised.value.__cause__.__cause__, LookupError)


async def test_an_error_with_no_cancellation_is_the_cleanups_own() -> None:
    async def mark() -> None:
        raise LookupError("refused")

    with pytest.raises(LookupError):
        await to_the_end(mark)


async def test_a_cleanup_cancelled_before_it_started_starts_again() -> None:
    """`asyncio.run` at its exit cancels the cleanup's task before its first step ran (it was
    made in the loop's last turn): a task cancelled before it starts never runs at all."""
    done: list[str] = []

    async def mark() -> None:
        done.append("marked")

    this = asyncio.current_task()
    caller = asyncio.ensure_future(to_the_end(mark))
    await asyncio.sleep(0)  # the caller makes the cleanup's task, not started yet
    for task in asyncio.all_tasks():
        if task is not this:
            task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert done == ["marked"]


async def test_past_its_bound_the_cancellation_goes_on() -> None:
    """Cancelled again and again (past the bound), the caller is cancelled all the same: the
    cleanup is given up, never a normal return with its steps skipped."""
    gate = asyncio.Event()

    async def mark() -> str:
        await gate.wait()
        return "marked"

    caller = asyncio.ensure_future(to_the_end(mark))
    for _ in range(150):
        await asyncio.sleep(0)
        caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 5)


async def test_a_steps_own_cancelled_error_goes_on_without_a_restart() -> None:
    """A step that ends with a CancelledError of its own (`unresolve_after` passes its
    execution's cancellation on when the mark fails) is not its task's cancellation: it is
    raised as it came, the step not started again (each try met the closed store anew)."""
    tries: list[int] = []

    async def mark() -> None:
        tries.append(1)
        raise asyncio.CancelledError("the execution's own")

    with pytest.raises(asyncio.CancelledError, match="the execution's own"):
        await to_the_end(mark)
    assert tries == [1]


async def test_an_anyio_cancel_scope_waits_for_the_cleanup() -> None:
    """An anyio cancel scope (BaseHTTPMiddleware's, at a shutdown) cancels every await of the
    task until it ends, again and again: a cleanup longer than a few turns of the loop was
    given up past its bound, the mark never sent. The cleanup shields itself from it."""
    done: list[str] = []

    async def mark() -> None:
        await asyncio.sleep(0.2)
        done.append("marked")

    with anyio.CancelScope() as scope:
        scope.cancel()
        await to_the_end(mark)
    assert done == ["marked"]
