"""Reconciliation: asking the downstream system what became of a request of unknown outcome."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from .jsonvalues import non_finite


@dataclass(frozen=True, slots=True)
class Happened:
    """The effect happened: here is the response the original request should have had.

    A 2xx/3xx status is stored as succeeded, another final 4xx (402 ...) as failed_final.
    The headers are stored as a handler's are: framing (Content-Length, Transfer-Encoding),
    hop-by-hop headers, Date, Server and Set-Cookie are left out; each replay adds its own.
    """

    status: int
    body: bytes = b""
    headers: Sequence[tuple[bytes, bytes]] = ()

    @classmethod
    def json(cls, status: int, content: Any) -> Happened:
        """`content` as a JSON body (ValueError for NaN or an infinity, which JSON would carry
        as null: replayed so for the record's whole retention)."""
        body = orjson.dumps(content)
        if b"null" in body and non_finite(content):
            raise ValueError("the content holds NaN or an infinity: pass it as a string")
        return cls(status, body, ((b"content-type", b"application/json"),))


@dataclass(frozen=True, slots=True)
class NotHappened:
    """The effect definitely did not happen: run the request again (under a new generation)."""


@dataclass(frozen=True, slots=True)
class StillUnknown:
    """The downstream system cannot tell yet; the record stays unknown."""

    reason: str = ""


Reconciliation = Happened | NotHappened | StillUnknown


@dataclass(slots=True, eq=False, kw_only=True)
class ReconcileContext:
    """What a reconciler knows of the unknown request, and where its writes go."""

    tenant: str
    operation: str
    key: str = field(repr=False)  # (it may carry personal data: the downstream key stands in)
    downstream_key: str
    #: The generation of the unknown record (the last executor's fencing token).
    generation: int
    _fence: Callable[[], Awaitable[Any]] = field(repr=False)

    async def fenced_connection(self) -> Any:
        """A connection in the transaction that commits with the record's new state.

        Business writes made here (the debit of a payout that did happen, say) commit together
        with `Happened`, or not at all.
        """
        return await self._fence()


Reconciler = Callable[[ReconcileContext], Awaitable[Reconciliation]]
