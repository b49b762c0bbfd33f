"""Request fingerprints: SHA-256 over the operation, params, chosen headers and canonical body.

What each part covers, and what the fingerprint guarantees, is in docs/fingerprint.md."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .errors import ProblemKind, RequestRejected
from .fingerprint_fast import canonical_json_fast, canonical_json_sorted
from .fingerprint_fields import is_json_pointer, json_fields, json_member
from .fingerprint_forms import (
    MAX_CACHED_TYPE,
    canonical_multipart,
    canonical_pairs,
    excluded_names,
    multipart_boundary,
    read_media_type,
)
from .fingerprint_json import canonical_json, parse_json_strict
from .hashing import SHORT_INPUT, long_sha256, sha256

if TYPE_CHECKING:
    from _hashlib import HASH

__all__ = [
    "FINGERPRINT_VERSION",
    "FingerprintSettings",
    "Fingerprinter",
    "canonical_body",
    "canonical_json",
    "compute_fingerprint",
    "is_json_pointer",
    "json_member",
    "parse_json_strict",
]

#: Part of every digest: a change to what is hashed gets a new version, so a digest made by an
#: older release never equals a newer one's for a different request. Version 2: numbers exact,
#: query and form pieces hashed undecoded, multipart parts length-prefixed, media types kept.
FINGERPRINT_VERSION: bytes = b"idem-fp-2"

#: Defaults of Policy.max_fields and Policy.max_json_values.
DEFAULT_MAX_FIELDS = 1000
DEFAULT_MAX_JSON_VALUES = 10_000

_U64 = struct.Struct(">Q").pack
_U64_PAIR = struct.Struct(">QQ").pack

_BAD_CHARSET = "JSON request bodies must be encoded in UTF-8."
#: UTF-8's names as clients send them (lower-cased): "utf8" is how MySQL and Java spell it.
_UTF8 = frozenset((b"utf-8", b"utf8"))
#: Charsets in which ASCII bytes are the same characters as in UTF-8: a JSON body of ASCII bytes
#: under one of them (older clients label every body ISO-8859-1) says exactly what it says in
#: UTF-8, and the handler's JSON reader, which decodes UTF-8 whatever the label, reads it so.
_ASCII_SUPERSETS = frozenset(
    (b"us-ascii", b"ascii", b"iso-8859-1", b"latin-1", b"latin1", b"iso-8859-15", b"windows-1252")
)
_FORM_NOT_UTF8 = "The form body is not valid UTF-8."


def canonical_body(
    content_type: bytes | None,
    body: bytes,
    exclude_fields: Sequence[str] = (),
    *,
    include_fields: Sequence[str] = (),
    max_fields: int = DEFAULT_MAX_FIELDS,
    max_json_values: int = DEFAULT_MAX_JSON_VALUES,
) -> tuple[bytes, bytes]:
    """Return (media tag, canonical bytes) for a request body.

    Only a JSON tag drops the Content-Type's parameters (its charset must be UTF-8); every other
    tag keeps the header as sent, less a multipart boundary, since a reader may honour them.
    With `include_fields`, a JSON body counts only by the members they name (less those
    `exclude_fields` removes), a sorted form only by the fields they name.
    """
    if not body:
        # Nothing sent, whatever the type: an endpoint that takes no body serves it (clients send
        # a JSON type on bodyless POSTs too), and one that needs a body refuses it itself.
        return b"empty", b""
    if content_type is None:
        return b"none", body
    media_type, params, is_json = read_media_type(content_type)
    if is_json:
        charset = params.get(b"charset")
        if (
            charset is not None
            and charset.lower() not in _UTF8
            and (charset.lower() not in _ASCII_SUPERSETS or not body.isascii())
        ):
            raise RequestRejected(ProblemKind.BODY_INVALID, _BAD_CHARSET)
        fast = canonical_json_fast(body, max_json_values)
        if fast is None:
            value = parse_json_strict(body, max_values=max_json_values)
            write = canonical_json
        elif not (exclude_fields or include_fields):
            return b"json:" + media_type, fast[1]
        else:
            value, write = fast[0], canonical_json_sorted
        # Both parsers return a fresh tree, so editing it in place is safe.
        selected = json_fields(value, include_fields, exclude_fields)
        if selected is not None:
            # Its own tag: a selection never equals a whole body that happens to look like one.
            if not all(map(str.isascii, selected)):
                # A configured pointer's characters might sort differently in orjson.
                write = canonical_json
            return b"json-fields:" + media_type, write(selected)
        return b"json:" + media_type, write(value)
    if media_type == b"application/x-www-form-urlencoded":
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestRejected(ProblemKind.BODY_INVALID, _FORM_NOT_UTF8) from None
        names = excluded_names(exclude_fields) if exclude_fields else frozenset()
        # (an allowlist of nested pointers alone selects no form field: the whole form counts)
        only = (excluded_names(include_fields) or None) if include_fields else None
        canonical = canonical_pairs(
            body, what="A form body", max_fields=max_fields, exclude=names, include=only
        )
        return b"form:" + content_type, canonical
    if media_type.startswith(b"multipart/"):
        boundary = multipart_boundary(content_type, params.get(b"boundary"))
        if boundary is not None:
            before, _, after = content_type.partition(boundary)
            tag = b"multipart:" + _U64(len(before)) + before + after
            parts = canonical_multipart(body, boundary, max_fields=max_fields)
            if parts is not None:
                return tag, parts
    return b"raw:" + content_type, body


def _framed(data: bytes) -> bytes:
    """`data` with its length in front (8 bytes, big-endian)."""
    return _U64(len(data)) + data


def _framed_count(count: int) -> bytes:
    """A list's count as a part of the stream: framed like any other part."""
    return _U64_PAIR(8, count)


#: An empty query string's part of the stream (computed the same way as any other), then with
#: an empty include_headers' count.
_NO_QUERY = _framed(canonical_pairs(b"", what="The query string", max_fields=1))
_NO_QUERY_NO_HEADERS = _NO_QUERY + _framed_count(0)
_VERSION = _framed(FINGERPRINT_VERSION)
_ONE_PARAM = _framed_count(1)


def _json_tag(content_type: bytes) -> bytes | None:
    """canonical_body's media tag for a JSON content type it accepts (no charset but UTF-8);
    None for any other (canonical_body then decides, and refuses what it refuses)."""
    media_type, params, is_json = read_media_type(content_type)
    charset = params.get(b"charset")
    if not is_json or (charset is not None and charset.lower() not in _UTF8):
        return None
    return b"json:" + media_type


#: `_json_tag`, kept for short content types (as read_media_type's: fingerprint_forms).
_cached_json_tag = lru_cache(maxsize=256)(_json_tag)


class FingerprintSettings(Protocol):
    """What a fingerprint reads of a policy (a `Policy` is one)."""

    @property
    def include_headers(self) -> Sequence[str]: ...
    @property
    def exclude_fields(self) -> Sequence[str]: ...
    @property
    def include_fields(self) -> Sequence[str]: ...
    @property
    def max_fields(self) -> int: ...
    @property
    def max_json_values(self) -> int: ...


class _Settings(NamedTuple):
    include_headers: Sequence[str]
    exclude_fields: Sequence[str]
    include_fields: Sequence[str]
    max_fields: int
    max_json_values: int


#: What a process sees again and again, framed once each (operations and path parameter names
#: are templates, not paths: the bound is never reached): per operation the stream's start (the
#: version and the operation), per name the name. A longer text is not kept: an operation named
#: by the path its mounts took (a sub-app the router above cannot see into) is the client's to
#: choose, and 1,500 such names of 60 KB held 176 MB for good.
_STARTS: dict[str, bytes] = {}
_NAMES: dict[str, bytes] = {}
_CACHED_TEXT_LENGTH = 512


def _framed_cached(text: str, cache: dict[str, bytes], head: bytes = b"") -> bytes:
    framed = head + _framed_text(text)
    if len(cache) < 10_000 and len(text) <= _CACHED_TEXT_LENGTH:
        cache[text] = framed
    return framed


#: The shortest head (`Fingerprinter`) whose hashed state is kept: one SHA-256 block. A shorter
#: head leaves no block hashed, and copying the state would cost more than hashing it again.
_HEAD_STATE_MIN = 64


class Fingerprinter:
    """compute_fingerprint for the requests of one path: its operation and path parameters are
    framed once (the middleware keeps one per path it matched, with the route's policy as its
    settings), and each request reads only its query string, headers and body. A JSON body,
    the common case, goes straight to canonical_json_fast (the tag and bytes canonical_body
    gives)."""

    __slots__ = ("_head", "_head_state", "_settings", "_tail_room", "_used", "_whole_body")

    def __init__(
        self, operation: str, path_params: Mapping[str, object], settings: FingerprintSettings
    ) -> None:
        # Every part is length-prefixed and every list is preceded by its count, so no two
        # different requests can produce the same byte stream.
        # (Built once per path: most paths hold an id, and a new one is met at each request.
        # Framed inline, as `_framed_count` and `_framed_text` frame: a call per part costs more.)
        count = len(path_params)
        start = _STARTS.get(operation) or _framed_cached(operation, _STARTS, _VERSION)
        if count == 1:  # (most such paths: one id; as below, without the list)
            [name] = path_params
            value = str(path_params[name]).encode("utf-8", "surrogatepass")
            framed = _NAMES.get(name) or _framed_cached(name, _NAMES)
            self._head = b"".join((start, _ONE_PARAM, framed, _U64(len(value)), value))
        else:
            head = [start, _U64_PAIR(8, count)]
            for name in sorted(path_params):  # (none, or two and more)
                value = str(path_params[name]).encode("utf-8", "surrogatepass")
                head += (_NAMES.get(name) or _framed_cached(name, _NAMES), _U64(len(value)), value)
            self._head = b"".join(head)
        # The head is the same in every request of the path: a head of a whole SHA-256 block or
        # more is hashed once, at the path's second request (most paths with an id in them see
        # one), and each request after hashes only what follows it, in a copy of that state (the
        # same digest; see `_HEAD_STATE_MIN`). `_tail_room` < 0: a head whose state is not kept.
        size = len(self._head)
        self._head_state: HASH | None = None
        self._used = False
        self._tail_room = SHORT_INPUT - size if _HEAD_STATE_MIN <= size <= SHORT_INPUT else -1
        self._settings = settings
        self._whole_body = not (settings.exclude_fields or settings.include_fields)

    def __call__(
        self,
        query_string: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        content_type: bytes | None,
        body: bytes,
    ) -> bytes:
        """The 32-byte SHA-256 fingerprint of this path's request (see compute_fingerprint)."""
        settings = self._settings
        # First, so an invalid body is refused before any hashing work.
        json_tag = None
        if self._whole_body and body and content_type is not None:
            short = len(content_type) <= MAX_CACHED_TYPE
            json_tag = _cached_json_tag(content_type) if short else _json_tag(content_type)
        if json_tag is not None:
            # canonical_body's JSON branch for a whole body, without its other checks.
            media_tag = json_tag
            fast = canonical_json_fast(body, settings.max_json_values)
            if fast is not None:
                canonical = fast[1]
            else:
                value = parse_json_strict(body, max_values=settings.max_json_values)
                canonical = canonical_json(value)
        else:
            media_tag, canonical = canonical_body(
                content_type,
                body,
                settings.exclude_fields,
                include_fields=settings.include_fields,
                max_fields=settings.max_fields,
                max_json_values=settings.max_json_values,
            )
        include_headers = settings.include_headers
        # (Built whole, hashed once; the parts are framed inline, as a call per part would cost
        # more than the framing.)
        head_state = self._head_state
        if head_state is None:
            if not self._used:
                self._used = True
            elif self._tail_room >= 0:  # the path's second request
                head_state = self._head_state = sha256(self._head)
        if not query_string and not include_headers:  # (most requests: no list to build)
            tag_size, size = _U64(len(media_tag)), _U64(len(canonical))
            if head_state is not None:
                data = b"".join((_NO_QUERY_NO_HEADERS, tag_size, media_tag, size, canonical))
            else:
                head = self._head
                data = b"".join((head, _NO_QUERY_NO_HEADERS, tag_size, media_tag, size, canonical))
        else:
            stream = [] if head_state is not None else [self._head]
            if query_string:
                query = canonical_pairs(
                    query_string, what="The query string", max_fields=settings.max_fields
                )
                stream += (_framed(query), _framed_count(len(include_headers)))
            else:
                stream += (_NO_QUERY, _framed_count(len(include_headers)))
            if include_headers:
                stream += _header_parts(headers, include_headers)
            stream += (_U64(len(media_tag)), media_tag, _U64(len(canonical)), canonical)
            data = b"".join(stream)
        if head_state is not None:
            if len(data) <= self._tail_room:
                hashed = head_state.copy()
                hashed.update(data)
                return hashed.digest()
            data = self._head + data  # a long stream: OpenSSL's, from the start
        # (Written out, not sha256_digest: a call more per request.)
        return (sha256 if len(data) <= SHORT_INPUT else long_sha256)(data).digest()


def _header_parts(
    headers: Sequence[tuple[bytes, bytes]], include_headers: Sequence[str]
) -> list[bytes]:
    """Each included header's name, then its values (a count of zero: absent), framed."""
    wanted = [header.lower().encode("latin-1", "replace") for header in include_headers]
    found: dict[bytes, list[bytes]] = {header_name: [] for header_name in wanted}
    for header_name, header_value in headers:
        values = found.get(header_name)
        if values is None:
            values = found.get(header_name.lower())
        if values is not None:
            values.append(header_value)
    parts = []
    for header_name in wanted:
        values = found[header_name]
        parts.append(_framed(header_name))
        # A count of zero is the "absent" marker; an empty value has a count of one.
        parts.append(_framed_count(len(values)))
        parts.extend(_framed(header_value) for header_value in values)
    return parts


def _framed_text(text: str) -> bytes:
    return _framed(text.encode("utf-8", "surrogatepass"))


def compute_fingerprint(
    *,
    operation: str,
    path_params: Mapping[str, object],
    query_string: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    include_headers: Sequence[str],
    content_type: bytes | None,
    body: bytes,
    exclude_fields: Sequence[str] = (),
    include_fields: Sequence[str] = (),
    max_fields: int = DEFAULT_MAX_FIELDS,
    max_json_values: int = DEFAULT_MAX_JSON_VALUES,
) -> bytes:
    """Return the 32-byte SHA-256 fingerprint of a request.

    A query string or form body with more than max_fields fields, or a JSON body with more
    than max_json_values values, is refused with RequestRejected(TOO_MANY_FIELDS).
    """
    settings = _Settings(
        include_headers, exclude_fields, include_fields, max_fields, max_json_values
    )
    fingerprinter = Fingerprinter(operation, path_params, settings)
    return fingerprinter(query_string, headers, content_type, body)


_COMPRESSED = (
    " It was sent with a Content-Encoding, which this server does not decode: send the body"
    " uncompressed."
)


def compressed_body_hint(refused: RequestRejected, scope: Mapping[str, Any]) -> str:
    """What a refusal of a body as invalid adds when the body came compressed: bodies count as
    they arrive (a decompressing middleware goes outside this one), so gzip bytes under a JSON
    type are refused as not UTF-8 or not JSON, which alone would send the client looking for a
    defect in the document it compressed."""
    if refused.kind is not ProblemKind.BODY_INVALID:
        return ""
    for name, value in scope["headers"]:
        if name.lower() == b"content-encoding" and value.strip(b" \t").lower() not in (
            b"",
            b"identity",
        ):
            return _COMPRESSED
    return ""
