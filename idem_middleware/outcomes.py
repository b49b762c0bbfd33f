"""The outcome rules, in one place: a response status becomes an outcome, an outcome a stored
state, and a record found under a key becomes what a duplicate is told.

Both modes and the jobs API use these; nothing here talks to a client or a store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum

from .answers import Answer, InFlight, Problem, Replay
from .errors import ProblemKind
from .policy import Mode
from .store.base import Record, Settlement, State, StoredResponse

logger = logging.getLogger("idem_middleware")


class Outcome(StrEnum):
    """How a claimed request ends; the handler may declare one instead of its status deciding."""

    #: Stored and replayed (2xx and 3xx by default).
    SUCCEEDED = "succeeded"
    #: Definitely did not happen and will not be retried: stored and replayed (402, ...).
    FAILED_FINAL = "failed_final"
    #: Nothing happened, fix and retry: not stored, the key is free again (400, 409, 422, ...).
    RELEASE = "release"
    #: Lease mode only: the effect may or may not have happened elsewhere.
    UNKNOWN = "unknown"


#: Responses meaning "nothing happened, fix the request and retry" (see docs/protocol.md). With
#: those whose fix the fingerprint cannot see (RFC 9110: nothing was performed): a Content-Length
#: (411), a precondition (412, 428), the very request again without its `Expect` (417) or over
#: another connection (421), smaller headers (431). Stored, each was replayed to the fixed retry.
RELEASE_STATUSES = frozenset(
    {400, 401, 403, 404, 405, 408, 409, 411, 412, 413, 415, 417, 421, 422, 425, 428, 429, 431}
)

#: The state an outcome is stored as; RELEASE and UNKNOWN are not final (no stored response).
FINAL_STATE = {Outcome.SUCCEEDED: State.SUCCEEDED, Outcome.FAILED_FINAL: State.FAILED_FINAL}
_UNRESOLVED = Settlement(State.UNKNOWN)


def settlement_for(outcome: Outcome, stored: Callable[[], StoredResponse]) -> Settlement | None:
    """A lease-mode execution's `outcome` as what the store records: a final state with the
    response (`stored()`, made only then), `unknown`, or None for a release."""
    state = FINAL_STATE.get(outcome)
    if state is not None:
        return Settlement(state, stored())
    return None if outcome is Outcome.RELEASE else _UNRESOLVED


_KEY_REUSED = Problem(
    ProblemKind.KEY_REUSED,
    "This Idempotency-Key was used for a different request; use a new key for a new request.",
)
_UNKNOWN = (
    "The original request's outcome is not known yet; it will not be run again until it is "
    "resolved."
)


def outcome_for_status(status: int, mode: Mode) -> Outcome:
    if status < 400:
        return Outcome.SUCCEEDED
    if status in RELEASE_STATUSES:
        return Outcome.RELEASE
    if status < 500:
        return Outcome.FAILED_FINAL
    # A 5xx after a rolled-back transaction left nothing behind; elsewhere it proves nothing.
    return Outcome.RELEASE if mode is Mode.TRANSACTIONAL else Outcome.UNKNOWN


def settled_answer(record: Record, fingerprint: bytes, *, http: bool = True) -> Answer | None:
    """What a duplicate is told by a record that answers it by itself: another request's
    (422, in any state), or a final outcome (the replay; for `http`, a 500 if its status is
    none a server sends). None: the record is pending or unknown, and the mode decides (wait,
    take over, reconcile)."""
    if record.fingerprint != fingerprint:
        return _KEY_REUSED
    response = record.response
    if record.state in (State.SUCCEEDED, State.FAILED_FINAL) and response is not None:
        if http and not 199 < response.status < 600:
            return _unsendable(record, response.status)
        return Replay(response)
    return None


def _unsendable(record: Record, status: int) -> Problem:
    """A record whose stored status the library never writes (a final status: sendable.py),
    set by hand or by an older version: replayed, it was a head servers refuse (uvicorn dropped
    the connection) for every retry, for the whole retention."""
    from .context import key_digest  # (context imports this module)
    from .observe import shown

    logger.error(
        "idempotency: the record (operation %s, key digest %s, generation %s; its tenant in "
        "`extra`) holds the status %d, which no server sends: its retries are answered 500 "
        "until an operator resolves it again (idem-middleware resolve --again)",
        shown(record.key.operation),
        key_digest(record.key.key),
        record.generation,
        status,
        extra={"tenant": record.key.tenant, "operation": record.key.operation},
    )
    return Problem(ProblemKind.MISCONFIGURED, _UNSENDABLE)


_UNSENDABLE = (
    "This request was processed and its outcome recorded, but the recorded response cannot be "
    "sent. Do not send it again under a new key: the server's operators must correct its record."
)


def duplicate_answer(record: Record, fingerprint: bytes, detail: str = "") -> Answer:
    """What a duplicate gets when nothing more can be done for it now: the fingerprint is
    compared first, in any state; then the replay, `outcome-unknown`, or in flight."""
    answer = settled_answer(record, fingerprint)
    if answer is not None:
        return answer
    if record.state is State.UNKNOWN:
        return Problem(ProblemKind.OUTCOME_UNKNOWN, f"{_UNKNOWN} {detail}".rstrip())
    return InFlight()
