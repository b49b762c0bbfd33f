"""The transactional outbox: events committed with the business write, published afterwards.

- `add(conn, topic, payload)` writes an event on the handler's connection, inside the same
  transaction as the business write and the idempotency outcome (transactional mode: the claim's
  connection; lease mode: `await idem.fenced_connection()`). A rolled-back request leaves no event.
- `Publisher` reserves due events one at a time (`FOR UPDATE SKIP LOCKED`, then a reservation
  committed with the attempt counted, so several publishers never send one event at the same
  time and no transaction stays open while sending), sends each through your sender (async), marks
  it sent, retries with exponential backoff, and parks an event after `max_attempts` attempts.
- Delivery is at least once: a publisher that dies after sending and before marking leaves the
  event reserved; it is sent again once the reservation lapses (`send_timeout_seconds +
  reservation_margin_seconds`, positive: the send's timeout starts after the reservation), that
  attempt counted. Consumers deduplicate by event id: `consume_once`, in their transaction.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from .errors import ConfigurationError, RetryableConflict, StatementRefused, StoreClosed
from .errors import EventConflict as EventConflict
from .jsonvalues import json_text
from .keys import MAX_KEY_LENGTH
from .outbox_values import answer_error as _answer_error
from .outbox_values import cancelled_since as _cancelled_since
from .outbox_values import cancelling as _cancelling
from .outbox_values import check_text as _check_text
from .outbox_values import checked_sender, checked_stop, event_ids_of, whole_count
from .outbox_values import error_text as _error_text
from .outbox_values import is_httpx as _httpx
from .outbox_values import seconds as _seconds
from .pool_arguments import checked_store as _store  # (a ValueError first: see there)
from .store.postgres.events import add_event, record_consumed
from .waiting import wait_at_most

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger("idem_middleware.outbox")

#: An event id is the outbox's primary key, and a consumer's: kept well within what a key's
#: index holds (about 2,700 bytes).
MAX_EVENT_ID_BYTES = 1024


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    event_id: str
    tenant: str | None
    topic: str
    payload: Any
    attempts: int


#: Sends one event; raises (or returns False) when the receiver did not take it. Async best: a
#: plain function's answer is taken, but it blocks the event loop, and no timeout stops it.
Sender = Callable[[OutboxEvent], Awaitable[bool | None] | bool | None]


async def add(
    conn: Any,
    topic: str,
    payload: Any,
    *,
    event_id: str | None = None,
    tenant: str | None = None,
) -> str:
    """Write an event in the caller's transaction; returns its id (a UUID unless given).

    Pass a deterministic `event_id` if the same logical event could be added twice by different
    requests: adding it again with the same tenant, topic and payload does nothing (it is sent
    once), and with anything else raises `EventConflict` (the caller's transaction goes on; what
    it does with the error is its business). Event ids are one namespace for every tenant and
    operation: derive one from a business row's id or from `idem.downstream_key`, never from the
    raw idempotency key (two tenants' keys may be equal: the second tenant's event would be
    refused, or, with the same payload and no `tenant`, silently never sent).

    What the database would refuse, or JSON would change, is refused before any statement, the
    caller's transaction untouched: a payload with NaN, an infinity, a NUL or a datetime whose
    UTC offset has seconds (JSON would write another instant), an empty
    `event_id` or one over MAX_EVENT_ID_BYTES, a NUL in the id, topic or tenant (ValueError);
    a value that is not a str, or a payload JSON cannot hold (TypeError).
    """
    # Refused here, before any statement: one the database refused would abort the caller's
    # transaction, its business write with it.
    if event_id is None:
        event_id = str(uuid.uuid4())
    else:
        _check_text(event_id, "event_id")
        if not 0 < len(event_id.encode()) <= MAX_EVENT_ID_BYTES:
            raise ValueError(f"an event_id is 1 to {MAX_EVENT_ID_BYTES} bytes of UTF-8")
    _check_text(topic, "topic")
    if tenant is not None:
        _check_text(tenant, "tenant")
    if not callable(getattr(conn, "fetchval", None)):  # (an AttributeError from inside, else)
        raise TypeError(f"add: conn is the handler's asyncpg connection, not {type(conn).__name__}")
    data = json_text(payload, "the event's payload")
    await add_event(conn, event_id, tenant, topic, data.decode())
    return event_id


async def consume_once(conn: Any, consumer: str, event_id: str) -> bool:
    """In the consumer's transaction: True the first time this consumer sees the event, False
    for a redelivery (apply nothing then). Commits or rolls back with the consumer's own writes.

    An `event_id` (often from a webhook's body) or a `consumer` that `text` cannot store (a
    NUL, an unpaired surrogate, not a str) or that is empty or over MAX_EVENT_ID_BYTES is
    refused before any statement (ValueError, TypeError): the consumer's transaction stays
    usable."""
    for value, name in ((consumer, "consumer"), (event_id, "event_id")):
        _check_text(value, name)
        if not 0 < len(value.encode()) <= MAX_EVENT_ID_BYTES:
            raise ValueError(f"a {name} is 1 to {MAX_EVENT_ID_BYTES} bytes of UTF-8")
    return await record_consumed(conn, consumer, event_id)


#: An event id `webhook_sender` can send as the Idempotency-Key header as it is (a bare token).
_HEADER_KEY = re.compile(rf"[\x21\x23-\x7e]{{1,{MAX_KEY_LENGTH}}}")


@dataclass
class PublishReport:
    sent: int = 0
    failed: int = 0
    parked: int = 0


class Publisher:
    def __init__(
        self,
        pool: Any,
        sender: Sender,
        *,
        batch_size: int = 50,
        max_attempts: int = 8,
        base_backoff_seconds: float = 1.0,
        max_backoff_seconds: float = 300.0,
        send_timeout_seconds: float = 10.0,
        reservation_margin_seconds: float = 5.0,
    ) -> None:
        # Checked here: a duration the database cannot add to now() (NaN, an infinity) failed
        # every batch, and `run` retried it for ever without publishing anything.
        for name, count in (("batch_size", batch_size), ("max_attempts", max_attempts)):
            whole_count(count, name)
        self.pool = pool
        self._store = _store(pool)
        self.sender = checked_sender(sender)
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.base_backoff_seconds = _seconds(base_backoff_seconds, "base_backoff_seconds", False)
        self.max_backoff_seconds = _seconds(max_backoff_seconds, "max_backoff_seconds", False)
        self.send_timeout_seconds = _seconds(send_timeout_seconds, "send_timeout_seconds", True)
        self.reservation_margin_seconds = _seconds(
            reservation_margin_seconds, "reservation_margin_seconds", True
        )

    def backoff(self, attempts: int) -> float:
        # (The exponent is capped first: 2**1024 is no float, and any cap is reached by then.)
        return float(
            min(self.base_backoff_seconds * 2 ** min(attempts, 64), self.max_backoff_seconds)
        )

    @property
    def reservation_seconds(self) -> float:
        """How long a reserved event is left to this publisher: a send is cut off well before."""
        return self.send_timeout_seconds + self.reservation_margin_seconds

    async def publish_batch(
        self, *, stop: asyncio.Event | None = None, report: PublishReport | None = None
    ) -> PublishReport:
        """Send up to `batch_size` due events, one at a time: reserve (the attempt counted, in a
        statement of its own), send, record the result. No connection is held during a send.
        Once `stop` is set, no further event is reserved: the batch ends after the current send.
        `report`, if given, is added to as it goes (and returned): it holds what a failed batch did.

        If this process dies mid-send, the event stays reserved until its reservation lapses,
        then any publisher sends it again; an event no publisher ever finishes sending is parked
        after `max_attempts` attempts like one that keeps failing.
        """
        report = PublishReport() if report is None else report
        outbox = self._store.outbox_connection
        for _ in range(self.batch_size):
            if stop is not None and stop.is_set():
                break  # (else a stopped publisher sent up to `batch_size` slow events more)
            # A pooled connection per statement, none during the send: a slow receiver held one
            # of the app's connections for the whole batch (up to batch_size sends).
            async with outbox() as conn:
                reserved = await conn.reserve(self.reservation_seconds, self.max_attempts)
            if reserved is None:
                break
            attempt = reserved.attempts
            if reserved.parked:
                report.parked += 1
                logger.warning(
                    "outbox event parked: no publisher finished sending it in %d attempts",
                    attempt,
                    extra={"event_id": reserved.event_id, "topic": reserved.topic},
                )
                continue
            error: str | None = None
            try:
                payload = orjson.loads(reserved.payload)
            except orjson.JSONDecodeError as exc:
                # A row not written by `add` (SQL, a trigger) with a number no float holds
                # (1e400): a failed send, backed off and parked with this error. Raised, it
                # ended every batch that reserved it, the events after it unsent.
                payload, error = None, f"the payload cannot be decoded: {exc}"
            event = OutboxEvent(  # (attempts: those before this one)
                reserved.event_id, reserved.tenant, reserved.topic, payload, attempt - 1
            )
            cancels = _cancelling()
            if error is None:
                error = await self._send(event)
            if error is None:
                report.sent += await self._mark(event, None, attempt)
            else:
                report.failed += 1
                if attempt >= self.max_attempts:
                    report.parked += 1
                    logger.warning(
                        "outbox event parked after %d attempts",
                        attempt,
                        extra={"event_id": event.event_id, "topic": event.topic},
                    )
                await self._mark(event, error, attempt)
            _cancelled_since(cancels)  # (a sender caught this task's cancellation: see there)
        return report

    async def _mark(self, event: OutboxEvent, error: str | None, attempt: int) -> bool:
        """Record a send's result: sent (`error` None), or failed. A statement the database
        refuses (a constraint, a trigger) is logged and ends nothing but this mark: the event
        stays reserved, and is sent again once its reservation lapses. A lost connection still
        ends the batch."""
        try:
            async with self._store.outbox_connection() as conn:
                if error is None:
                    await conn.mark_sent(event.event_id)
                else:
                    await conn.mark_failed(
                        event.event_id,
                        error,
                        self.backoff(event.attempts),
                        self.max_attempts,
                        attempt,
                    )
        except (StatementRefused, RetryableConflict):
            logger.error(
                "recording an outbox send's result failed; it is sent again later",
                extra={"event_id": event.event_id, "topic": event.topic},
                exc_info=True,
            )
            return False
        return True

    async def _send(self, event: OutboxEvent) -> str | None:
        try:
            async with asyncio.timeout(self.send_timeout_seconds):
                accepted = self.sender(event)
                if inspect.isawaitable(accepted):
                    accepted = await accepted
                # (Else a plain function's answer, the event sent already: awaited, it failed
                # after every delivery, and the event was sent again, its attempts long.)
        except Exception as exc:  # the receiver's failure is data here, not our crash
            return _error_text(exc)
        except asyncio.CancelledError as exc:
            # The sender's own CancelledError (a cancel scope of its client's, say), not this
            # task's cancellation: a failed send, or it would end `run` at every such event.
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            return _error_text(exc) + " (raised by the sender)"
        return _answer_error(accepted)  # (True or None: delivered; anything else is not)

    async def run(
        self,
        *,
        idle_seconds: float = 1.0,
        stop: asyncio.Event | None = None,
        batches: int | None = None,
        report: PublishReport | None = None,
    ) -> PublishReport:
        """Publish until `stop` is set or `batches` batches ran; idle: sleep `idle_seconds`.
        A failed batch is logged and retried, backing off; the last of `batches` raises its error
        at once instead, as does a closed store or pool (StoreClosed) or an outbox its role
        cannot see whole (ConfigurationError): no batch could succeed.
        `report`, if given, is added to as it goes, as `publish_batch`'s."""
        _seconds(idle_seconds, "idle_seconds", True)  # (0 would poll the database in a loop)
        if batches is not None:  # (0 or -1 did nothing; "2" and 1.5 failed, or swallowed errors)
            whole_count(batches, "batches")
        total = PublishReport() if report is None else report
        stop = checked_stop(stop)
        done = fails = 0  # (fails: batches failed in a row)
        while not stop.is_set() and (batches is None or done < batches):
            done += 1
            before = total.sent + total.failed
            try:
                await self.publish_batch(stop=stop, report=total)
            except (StoreClosed, ConfigurationError):
                raise  # (no batch could succeed: each was retried for ever, a warning a minute)
            except Exception:
                if done == batches:
                    raise
                # The database went away (a restart, a failover): an event being sent stays
                # reserved, sent again once that lapses. Back off while it stays down: from
                # `idle_seconds` at least, doubling, whatever the events' backoff (at 0: a loop).
                fails += 1
                logger.warning("outbox batch failed; retrying", exc_info=True)
                delay = max(self.backoff(min(fails, 6)), idle_seconds * 2 ** min(fails - 1, 6))
                await wait_at_most(stop, delay)
                continue
            fails = 0
            if total.sent + total.failed == before and done != batches:  # (none after the last)
                await wait_at_most(stop, idle_seconds)
        return total


async def outbox_stats(pool: Any) -> dict[str, Any]:
    return await _store(pool).outbox_stats()


async def list_events(
    pool: Any, *, parked_only: bool = False, limit: int = 100
) -> list[dict[str, Any]]:
    return await _store(pool).outbox_events(parked_only=parked_only, limit=limit)


async def requeue(pool: Any, event_ids: Iterable[str]) -> int:
    """How many of the parked events `event_ids` are sent again (`requeue_each`: which)."""
    return sum(outcome == "requeued" for outcome in (await requeue_each(pool, event_ids)).values())


async def requeue_each(pool: Any, event_ids: Iterable[str]) -> dict[str, str]:
    """Send the parked events `event_ids` again: each id's outcome, `requeued`, or why not:
    `unknown` (no such event), `unsent` (not parked: still being tried) or `sent`."""
    return await _store(pool).outbox_requeue(event_ids_of(event_ids))


async def purge_sent(
    pool: Any,
    *,
    older_than_seconds: float = 7 * 86400,
    batch_size: int = 1000,
    max_batches: int = 10_000,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete events sent over `older_than_seconds` ago (finite, from 0), `batch_size` a statement,
    `max_batches` at most (whole, from 1; else ValueError first): how many; `progress(n)` each."""
    age = _seconds(older_than_seconds, "older_than_seconds", False)
    return await _store(pool, "purge_sent", progress).outbox_purge(
        batch_size, age, max_batches, progress
    )


def webhook_sender(client: Any, url: str | httpx.URL) -> Callable[[OutboxEvent], Awaitable[bool]]:
    """A Sender that POSTs `{"event_id", "topic", "payload"}` to `url` with an httpx AsyncClient.

    The event id travels as the body's `event_id` and as the `Idempotency-Key` header, so the
    receiver can deduplicate. Any 2xx is delivered; anything else is retried. An id that cannot
    travel as that header as it is (1 to 255 printable ASCII characters, no space or `"`) fails
    its sends with a ValueError saying so (the event is parked after its attempts).
    """

    if not callable(getattr(client, "post", None)) or _httpx(client, "Client"):
        raise TypeError(  # (a sync httpx.Client's post delivered, then failed as awaited)
            f"webhook_sender takes an async client (httpx.AsyncClient), not {client!r:.80}"
        )
    if not isinstance(url, str) and not _httpx(url, "URL"):  # (each send failed, then parked)
        raise TypeError(f"webhook_sender's url is a str (str(url)), not a {type(url).__name__}")

    async def send(event: OutboxEvent) -> bool:
        if _HEADER_KEY.fullmatch(event.event_id) is None:
            raise ValueError(
                "this event's id cannot be sent as an Idempotency-Key header (1 to "
                f"{MAX_KEY_LENGTH} printable ASCII characters, no space or '\"')"
            )
        response = client.post(
            url,
            json={"event_id": event.event_id, "topic": event.topic, "payload": event.payload},
            headers={"Idempotency-Key": event.event_id},
        )
        if inspect.isawaitable(response):  # (a sync client's answer as it is: awaited, it failed
            response = await response  # after each delivery, and the event was sent again)
        if not 200 <= response.status_code < 300:
            raise RuntimeError(f"the receiver answered {response.status_code}")
        return True

    return send
