"""What a mode decides to tell the client, as values: the exchange sends them (answers flow one
way, from the modes back to the exchange, which alone writes to the client)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ProblemKind
from .frozen import quick_init
from .store.base import StoredResponse

#: The detail of `429 tenant-busy`, in both modes.
TENANT_BUSY = "Too many of your requests are being processed at once; retry shortly."
#: The detail of the `409 request-in-flight` a duplicate gets when the waiters are all taken.
WAITERS_FULL = (
    "The original request is still being processed, and too many requests are waiting already; "
    "retry later."
)


class Answer:
    """Base of the answers below, and of `capture.ResponseCapture` (the transactional attempt is
    one): the handler's own response, held until its outcome was recorded, is answered by its
    capture (the exchange flushes it)."""

    __slots__ = ()


@quick_init  # (see frozen.py)
@dataclass(frozen=True, slots=True)
class Replay(Answer):
    """The stored response, marked as a replay."""

    response: StoredResponse


@quick_init  # (see frozen.py)
@dataclass(frozen=True, slots=True)
class Problem(Answer):
    """A problem+json refusal (`retry_after`: seconds, or None for no Retry-After; `counted`:
    the request's end was counted already, not to be counted again by the problem's kind)."""

    kind: ProblemKind
    detail: str
    retry_after: int | None = None
    counted: bool = False


def request_digest(fingerprint: bytes) -> str:
    """What a 202's Location says of its request (see `InFlight.fingerprint`): 96 bits of its
    fingerprint, enough to tell it from the original's, in a URL that already holds the key."""
    return fingerprint[:12].hex()


@quick_init  # (see frozen.py)
@dataclass(frozen=True, slots=True)
class InFlight(Answer):
    """The original is still running: 409 + Retry-After, or 202 + Location if the policy says
    so (the exchange knows the policy and the status resource's path)."""

    detail: str = "The original request is still being processed; retry later."
    #: This request's fingerprint (both modes give it): the 202's Location carries a
    #: digest of it, and the status resource answers `422 key-reused` once the record it reads
    #: shows another request (an uncommitted original's, once committed; a corrected request
    #: claimed after a lease-mode original was released).
    fingerprint: bytes | None = None


@dataclass(frozen=True, slots=True)
class Sent(Answer):
    """Nothing more to send: the response streamed already (settled before its first byte)."""


SENT = Sent()
