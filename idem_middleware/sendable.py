"""Whether a server will send a response head, by one rule: what the servers the library is
tested behind all send (uvicorn with h11 or httptools; hypercorn speaks HTTP/1.1 through h11
too, and HTTP/2 through h2). A status that is an `int` from 200 to 599 (a 1xx is no final
response: early hints have a message of their own); header names that are HTTP tokens; values
of bytes with no control character but the tab (h11 refuses all of them but the tab, httptools
NUL, CR, LF and the others below 0x20 and DEL) that neither start nor end with a space or a tab
(h11). Bytes over 0x7F pass (obs-text: both servers send them). No `Proxy-Connection` (h2
refuses it; the other connection-specific headers are never stored).

A head a server refuses is worse than an error once its outcome is recorded: every retry
replays it and is refused again (a dropped connection for the whole retention). So:
- a handler's status is checked at its `http.response.start` (an `int` test, nearly free), and
  refused there as the server would refuse it: the handler's exception, with that exception's
  outcome (transactional: rolled back, the key free; lease mode: `unknown`);
- its headers are not (a check costs about ten thousand instructions per response, more than
  the budget of the hot path: see docs/decisions.md). A header no server sends is refused by the
  server once the outcome is recorded; the replay (`sendable_headers`) leaves it out, so the
  retry gets the outcome (a value refused only for a space at an end is replayed stripped of
  it: the same field to HTTP, and what httptools sends where h11 refuses it);
- a replay hook's response is checked whole (`head_problem`) before it replaces the record's.
"""

from __future__ import annotations

import re
from itertools import chain
from typing import Any

_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]++"
_VALUE = rb"(?![ \t])[^\x00-\x08\x0a-\x1f\x7f]*+(?<![ \t])"
#: (`Proxy-Connection`, which HTTP/2 stacks refuse as connection-specific, is no field either:
#: responses.py never stores it; a record stored before that may hold it.)
_FIELD = rb"(?!(?i:proxy-connection)\x00)" + _TOKEN + rb"\x00" + _VALUE
#: The headers as one string, names and values in turn with a NUL after each but the last: no
#: name or value the rule allows has a NUL, and the count of NULs says none brought one of its own.
_FIELDS = re.compile(_FIELD + rb"(?:\x00" + _FIELD + rb")*+").fullmatch
_ONE_FIELD = re.compile(_FIELD).fullmatch
_JOIN = b"\x00".join
_FLAT = chain.from_iterable


class UnsendableResponse(RuntimeError):
    """A handler's response head that servers refuse to send (see the module's docstring)."""


def final_status(status: Any) -> int:
    """`status` as the plain int it is (an `HTTPStatus` member, or any int's subclass but a
    bool: servers send it as its number), a final HTTP status; UnsendableResponse otherwise
    (the caller tests `type(status) is int and 199 < status < 600` inline: a call costs more
    than the test)."""
    if isinstance(status, int) and not isinstance(status, bool) and 199 < status < 600:
        return int(status)
    raise UnsendableResponse(f"the response cannot be sent: {head_problem(status, ())}")


def head_problem(status: Any, headers: Any) -> str | None:
    """Why a server would refuse a response with this status and these headers (a list or
    tuple of pairs), or None. Never quotes a value (it may carry what the response does)."""
    if isinstance(status, bool) or not isinstance(status, int) or not 199 < status < 600:
        return f"the status {status!r:.40} is not a final HTTP status (an int from 200 to 599)"
    if not headers or _all_sendable(headers):
        return None
    for pair in headers:
        refused = header_problem(pair)
        if refused is not None:
            return f"the header {refused} cannot be sent"
    return None  # pragma: no cover - _all_sendable found one


def _all_sendable(headers: Any) -> bool:
    """Whether every header passes."""
    try:
        blob = _JOIN(_FLAT(headers))
    except TypeError:
        return False  # a name or value that is not bytes, or a pair that is not a sequence
    return _FIELDS(blob) is not None and blob.count(b"\x00") == 2 * len(headers) - 1


def header_problem(pair: Any) -> str | None:
    """Why one header is refused, naming it (at most 64 bytes of its name), or None."""
    try:
        name, value = pair
    except (TypeError, ValueError):
        return f"{type(pair).__name__} (headers are pairs of bytes)"
    if type(name) is not bytes or type(value) is not bytes:
        return f"{name!r:.70} (its name and value must be bytes)"
    if name.lower() == b"proxy-connection":
        return f"{name!r} (connection-specific: HTTP/2 refuses it)"
    if _ONE_FIELD(name + b"\x00" + value) is None:
        return (
            f"{name[:64]!r} (a name that is not a token, or a control character or an edge "
            "space in its value)"
        )
    return None


def sendable_headers(headers: Any) -> tuple[list[tuple[bytes, bytes]], list[str]]:
    """`headers` without those a server refuses, and the refused ones, named: for a replay of
    a record stored before heads were checked (a retry must get something it can read)."""
    if _all_sendable(headers):
        return list(headers), []
    kept, refused = [], []
    for pair in headers:
        why = header_problem(pair)
        if why is None:
            kept.append((pair[0], pair[1]))
        elif (trimmed := _trimmed(pair)) is not None:
            kept.append(trimmed)
        else:
            refused.append(why)
    return kept, refused


def _trimmed(pair: Any) -> tuple[bytes, bytes] | None:
    """A header refused only for a space or tab at an end of its value, with them stripped: the
    same field to HTTP (RFC 9110 5.5: a field value has no leading or trailing whitespace), and
    what httptools sent the first client, where h11 refused it."""
    if type(pair) not in (tuple, list) or len(pair) != 2:
        return None
    name, value = pair
    if type(name) is not bytes or type(value) is not bytes:
        return None
    stripped = value.strip(b" \t")
    if stripped == value or _ONE_FIELD(name + b"\x00" + stripped) is None:
        return None
    return name, stripped


_BYTES_LIKE = (bytes, bytearray, memoryview)


def bytes_pairs(headers: Any) -> list[tuple[bytes, bytes]]:
    """Headers as pairs of `bytes`: a `bytearray` or `memoryview` name or value, which servers
    send as they are, made `bytes`; a pair of anything else, which no server sends, left out."""
    pairs = []
    for pair in headers:
        if (
            isinstance(pair, tuple | list)
            and len(pair) == 2
            and isinstance(pair[0], _BYTES_LIKE)
            and isinstance(pair[1], _BYTES_LIKE)
        ):
            pairs.append((bytes(pair[0]), bytes(pair[1])))
    return pairs
