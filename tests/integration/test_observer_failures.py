"""An observer that fails (a metrics collector, a tracer, a log handler that raises) never
changes a request's answer: not the claim, not the handler's single run, not the stored outcome
or its replay. Each decision and each timed step is broken in turn, in both modes, on both
stores; the key must end settled and replayed, the handler run once, and the failure logged."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import MemoryStore, Mode, Policy
from idem_middleware.errors import StoreError
from idem_middleware.observe import Event
from idem_middleware.store.base import RecordKey
from tests.apps import client, one_route_app

STEPS = ("claim", "complete", "replay")
#: Each decision the requests below meet, each step's timer, and all of them at once.
EVENTS = ("rejected", "claimed", "succeeded", "replayed", "mismatch")
BREAKS = [f"event {e}" for e in EVENTS] + [
    f"{when} {step}" for when in ("starting", "ending") for step in STEPS
]
BREAKS.append("everything")


class Broken:
    """Raises at one decision, or when one step's timer starts or ends."""

    def __init__(self, where: str) -> None:
        self.where = where

    def event(self, event: Event, attributes: Any) -> None:
        if self.where in (f"event {event.value}", "everything"):
            raise RuntimeError("the collector broke")

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Any) -> Iterator[None]:
        if self.where in (f"starting {name}", "everything"):
            raise RuntimeError("the tracer broke")
        yield
        if self.where in (f"ending {name}", "everything"):
            raise RuntimeError("the exporter broke")


class Counting:
    """A healthy observer beside the broken one: still called."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def event(self, event: Event, attributes: Any) -> None:
        self.events.append(event.value)

    @contextlib.contextmanager
    def timed(self, name: str, attributes: Any) -> Iterator[None]:
        yield


def paying() -> tuple[Any, list[int]]:
    runs: list[int] = []

    async def pay(request: Request) -> Response:
        await request.body()
        runs.append(1)
        return JSONResponse({"run": len(runs)}, status_code=201)

    return pay, runs


@pytest.mark.parametrize("mode", ["transactional", "lease"])
@pytest.mark.parametrize("where", BREAKS)
async def test_a_failing_observer_changes_no_answer(
    store: Any, mode: str, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    lease = {"mode": Mode.LEASE, "lease_seconds": 30} if mode == "lease" else {}
    policy = Policy(wait_seconds=0.2, **lease)  # type: ignore[arg-type]
    broken, healthy = Broken(where), Counting()
    pay, runs = paying()
    app = one_route_app(
        "/pay", pay, store=store, default_policy=policy, observers=[broken, healthy]
    )
    key = {"idempotency-key": "k-observed"}
    with caplog.at_level(logging.DEBUG, logger="idem_middleware"):
        async with client(app) as c:
            keyless = await c.post("/pay", json={"a": 1})
            first = await c.post("/pay", json={"a": 1}, headers=key)
            again = await c.post("/pay", json={"a": 1}, headers=key)
            other = await c.post("/pay", json={"a": 2}, headers=key)
            third = await c.post("/pay", json={"a": 1}, headers=key)
    answers = [r.status_code for r in (keyless, first, again, other, third)]
    assert answers == [400, 201, 201, 422, 201], (where, first.text, third.text)
    assert first.json() == again.json() == third.json() == {"run": 1}
    assert again.headers.get("idempotent-replayed") == "true"
    assert len(runs) == 1
    seen = ["rejected", "claimed", "succeeded", "replayed", "mismatch", "replayed"]
    assert healthy.events == seen
    record = await store.get(RecordKey("tenant-a", "POST /pay", "k-observed"))
    assert record is not None
    assert record.state.value == "succeeded"
    failures = [r for r in caplog.records if "observer Broken failed" in r.getMessage()]
    assert failures, "the observer's failure was not logged"
    assert failures[0].levelno == logging.WARNING
    assert failures[0].exc_info
    assert all(r.levelno == logging.DEBUG for r in failures[1:])


class DownStore(MemoryStore):
    async def claim_lease(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreError("the store is down")


class Swallowing(Counting):
    """A timer that returns True from __exit__: it would hide the step's own error."""

    def timed(self, name: str, attributes: Any) -> Any:
        return contextlib.suppress(Exception)


async def test_an_observer_cannot_swallow_a_steps_error() -> None:
    """The claim fails (store down): 503 store-unavailable, as with no observer, not a 500 from
    a claim that seemed to return nothing."""
    pay, runs = paying()
    policy = Policy(mode=Mode.LEASE, lease_seconds=30)
    app = one_route_app(
        "/pay", pay, store=DownStore(), default_policy=policy, observers=[Swallowing()]
    )
    async with client(app) as c:
        r = await c.post("/pay", json={"a": 1}, headers={"idempotency-key": "k"})
    assert r.status_code == 503, r.text
    assert runs == []
