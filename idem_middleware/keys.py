"""Parsing of the Idempotency-Key request header (an RFC 8941 sf-string, or a bare token), and
the request's headers by name that it is read from."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from .errors import ProblemKind, RequestRejected

__all__ = [
    "KEY_HEADER",
    "MAX_KEY_LENGTH",
    "check_key",
    "header_map",
    "parse_idempotency_key",
    "parse_key_value",
    "token_hash",
]

MAX_KEY_LENGTH = 255

#: The header's name as ASGI servers send it (lower case).
KEY_HEADER = b"idempotency-key"
_HEADER_NAME_LEN = len(KEY_HEADER)
_OWS = b" \t"

# The whole header value once OWS is stripped: a quote, then printable ASCII other than `"`
# and `\`, or one of the two escapes sf-string allows, then the closing quote and nothing else.
_SF_STRING = re.compile(rb'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_SF_ESCAPE = re.compile(rb"\\(.)")
# Bare tokens are kept for clients that never quoted the key; `"` is excluded so a broken
# quoted value can never be read as a token.
_BARE_TOKEN = re.compile(rb"[\x21\x23-\x7e]{1,%d}" % MAX_KEY_LENGTH)

_DUPLICATE = "The Idempotency-Key header must be sent only once."
_MALFORMED = "The Idempotency-Key header is not a valid structured-field string."
_BAD_KEY = (
    f"The Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable ASCII characters; a key with a"
    " space or a double quote is sent quoted, as a structured-field string."
)


def parse_idempotency_key(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """Return the key from raw ASGI headers, None when absent; RequestRejected when invalid.

    (Headers known to be lower case with no name repeated, as `header_map` finds
    them, need no scan: the value under `KEY_HEADER`, if any, goes to `parse_key_value`.)"""
    raw: bytes | None = None
    for name, value in headers:
        # ASGI servers lower-case names, but a hand-built scope may not; the length test
        # keeps the lower() off almost every other header.
        if len(name) == _HEADER_NAME_LEN and (name == KEY_HEADER or name.lower() == KEY_HEADER):
            if raw is not None:
                raise RequestRejected(ProblemKind.INVALID_KEY, _DUPLICATE)
            raw = value
    if raw is None:
        return None
    return parse_key_value(raw)


def parse_key_value(raw: bytes, header: str | None = None) -> str:
    """The key a header value carries (as `parse_idempotency_key` reads it); RequestRejected
    naming `header` (default: Idempotency-Key) when invalid."""
    value = raw.strip(_OWS)
    if value[:1] == b'"':
        match = _SF_STRING.fullmatch(value)
        if match is None:
            raise _rejected(_MALFORMED, header)
        key = match.group(1)
        if b"\\" in key:
            key = _SF_ESCAPE.sub(rb"\1", key)
        if not 0 < len(key) <= MAX_KEY_LENGTH:
            raise _rejected(_BAD_KEY, header)
    elif _BARE_TOKEN.fullmatch(value) is not None:
        key = value
    else:
        raise _rejected(_BAD_KEY, header)
    # Both branches admit only 0x20-0x7e, so ASCII decoding cannot fail.
    return key.decode("ascii")


def _rejected(detail: str, header: str | None) -> RequestRejected:
    if header is not None:
        detail = detail.replace("Idempotency-Key", header)
    return RequestRejected(ProblemKind.INVALID_KEY, detail)


# Every key the header can carry, once decoded: what `check_key` accepts.
_DECODED_KEY = re.compile(rf"[\x20-\x7e]{{1,{MAX_KEY_LENGTH}}}")


def check_key(key: str) -> str:
    """A key given in decoded form (the status resource's query parameter): accepted exactly
    when some Idempotency-Key header carries it; RequestRejected otherwise."""
    if _DECODED_KEY.fullmatch(key) is None:
        raise RequestRejected(ProblemKind.INVALID_KEY, _BAD_KEY)
    return key


def token_hash(token: str) -> bytes:
    """One-time tokens are stored, and looked up, only as this hash."""
    return hashlib.sha256(token.encode()).digest()


def header_map(scope: Any) -> dict[bytes, bytes] | None:
    """A request's headers by name, built in C, when they are a list of lower-case names in
    which no name repeats (as ASGI servers send them); None otherwise: then each reader scans
    the list as before, finding the first of each and a name repeated in another case."""
    headers = scope["headers"]
    if type(headers) is not list:
        # Any iterable (ASGI's type), read more than once on the way (the key, the body's
        # headers, the fingerprint, then the app): a one-shot one reached the app empty. Made a
        # list in the scope once, as Starlette's `Headers` makes it.
        headers = scope["headers"] = list(headers)
    try:
        by_name = dict(headers)
        if len(by_name) == len(headers) and b"".join(by_name).islower():
            return by_name
    except (TypeError, ValueError):
        pass  # not pairs of bytes: the readers' scans report it as they always did
    return None


def host_header(scope: Any) -> bytes | None:
    """The Host header (`Host` routes match on it), from the scope's headers."""
    for name, value in scope["headers"]:
        if name == b"host":
            return value  # type: ignore[no-any-return]
    return None
