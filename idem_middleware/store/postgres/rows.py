"""The driver's edge for values: rows into records, records and settlements into a statement's
arguments, and the NOTIFY payload that names a record (errors: convert.py)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import orjson

from ...context import key_digest
from ...observe import shown
from ...sendable import bytes_pairs
from ..base import Record, RecordKey, Settlement, State, StoredResponse

logger = logging.getLogger("idem_middleware.store")


def encode_headers(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    # latin-1 maps every byte to one code point, so any header value survives the round trip.
    try:
        return orjson.dumps([(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers])
    except (AttributeError, TypeError, ValueError):
        # A header that is not two bytes (a handler's `str`): no server sends it and no replay
        # would (sendable.py); the outcome is recorded without it, as the twin's replay has it.
        # (A `memoryview`, which servers send, is made `bytes`, as the in-memory store keeps it.)
        kept = bytes_pairs(headers)
        return orjson.dumps([(n.decode("latin-1"), v.decode("latin-1")) for n, v in kept])


def decode_headers(blob: bytes | None) -> list[tuple[bytes, bytes]]:
    if not blob:
        return []
    pairs = orjson.loads(blob)
    # (A JSON object's keys would be taken for pairs of letters; so would a pair that is a
    # string of two letters, or an object of two keys: its keys, `name: value`.)
    if type(pairs) is not list or any(type(pair) is not list for pair in pairs):
        raise TypeError("stored headers are not a JSON list of [name, value] lists")
    return [(n.encode("latin-1"), v.encode("latin-1")) for n, v in pairs]


def _readable_headers(key: RecordKey, row: Any) -> list[tuple[bytes, bytes]]:
    """The headers of a record whose `response_headers` the library never wrote (edited by hand,
    damaged): those that decode, the rest left out of its replays with a warning naming the
    record. (Raised, the error was the server's bare 500 to every retry for the retention, and
    to the status resource.)"""
    try:
        pairs = orjson.loads(row["response_headers"])
    except ValueError:
        pairs = None
    kept = []
    for pair in pairs if type(pairs) is list else ():
        if type(pair) is list and len(pair) == 2:
            try:
                kept.append((pair[0].encode("latin-1"), pair[1].encode("latin-1")))
            except (AttributeError, ValueError):
                continue
    logger.warning(
        "idempotency: the stored headers of the record (operation %s, key digest %s, generation "
        "%s; its tenant in `extra`) are not what the library writes (a JSON list of pairs of "
        "Latin-1 text): %d of them are replayed",
        shown(key.operation),
        key_digest(key.key),
        row["generation"],
        len(kept),
        extra={"tenant": key.tenant, "operation": key.operation},
    )
    return kept


def to_record(key: RecordKey, row: Any) -> Record:
    status = row["response_status"]
    response = None
    if status is not None:
        try:
            headers = decode_headers(row["response_headers"])
        except (AttributeError, TypeError, ValueError):  # (UnicodeEncodeError is a ValueError)
            headers = _readable_headers(key, row)
        response = StoredResponse(
            status=status,
            headers=headers,
            body=row["response_body"] or b"",
            body_omitted=row["body_omitted"],
        )
    return Record(
        key=key,
        fingerprint=row["fingerprint"],
        state=State(row["state"]),
        generation=row["generation"],
        response=response,
        expired=bool(row["expired"]),
        lease_expired=bool(row["lease_expired"]),
        retry_allowed=bool(row["retry_allowed"]),
        epoch=row["epoch"],
    )


#: The one channel lease-mode settlements notify on; the payload says which record.
NOTIFY_CHANNEL = "idem_middleware"


def notify_token(key: RecordKey) -> str:
    """The NOTIFY payload for a record: short, fixed-length, and no raw key on the wire."""
    raw = "\x00".join((key.tenant, key.operation, key.key)).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def completion_args(
    key: RecordKey,
    generation: int,
    state: State,
    response: StoredResponse,
    deferred: tuple[bytes, float] | None,
) -> tuple[str, tuple[Any, ...]]:
    """A transactional claim's completing statement and its parameters: the pending record's
    UPDATE (`complete`), or for a claim that wrote nothing yet (`deferred`: the fingerprint and
    retention its record is inserted with) the record's one INSERT (`insert_final`)."""
    headers = encode_headers(response.headers)
    if deferred is None:
        return "complete", (
            key.tenant,
            key.operation,
            key.key,
            generation,
            str(state),  # (its text: `.value` is a Python property of Enum's)
            response.status,
            headers,
            response.body,
            response.body_omitted,
        )
    fingerprint, retention_seconds = deferred
    return "insert_final", (
        key.tenant,
        key.operation,
        key.key,
        fingerprint,
        generation,
        retention_seconds,
        str(state),
        response.status,
        headers,
        response.body,
        response.body_omitted,
    )


def settle_args(key: RecordKey, generation: int, expected: State, s: Settlement) -> tuple[Any, ...]:
    """The parameters of `settle` (and of the fused `settle_checked`)."""
    r = s.response
    return (
        key.tenant,
        key.operation,
        key.key,
        generation,
        str(expected),  # (a StrEnum's text; `.value` is a Python property of Enum's)
        str(s.state),
        None if r is None else r.status,
        None if r is None else encode_headers(r.headers),
        None if r is None else r.body,
        None if r is None else r.body_omitted,
        s.note,
        notify_token(key),
    )


def token_problem(row: Any) -> str:
    """Why a token cannot be claimed (from a `token_status` row), or "" if it can."""
    if row is None:
        return "This key is not a token issued to you for this operation."
    if not row["same_operation"]:
        return "This token was issued for another operation."
    if not row["unused"]:
        return "This token was already used; ask for a new one."
    if not row["live"]:
        return "This token has expired; ask for a new one."
    if not row["same_request"]:
        return "This token was issued for a different request."
    return ""
