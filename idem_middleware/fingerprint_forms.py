"""Canonical forms of query strings, urlencoded form bodies and multipart bodies.

Nothing here decodes: pieces are hashed as sent, so two requests that any reader (parse_qsl,
python-multipart, a handler calling request.json() on a form body) could read differently never
canonicalise alike. Only what no reader can tell apart is normalised: the order of fields with
different plain names, and a multipart body's boundary."""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from functools import lru_cache
from operator import itemgetter

from .errors import ProblemKind, RequestRejected

__all__ = [
    "canonical_multipart",
    "canonical_pairs",
    "multipart_boundary",
    "parse_media_type",
    "read_media_type",
]

_U64 = struct.Struct(">Q").pack

# A name any reader decodes to itself: no %-escape, no "+", nothing outside printable ASCII, and
# no '"' (so no valid JSON text with an "&" ever qualifies: its first name holds a quote). Not
# empty: readers differ on empty pieces ("a&&b", a trailing "&").
_PLAIN_NAME = re.compile(rb"[A-Za-z0-9._~\-\[\]!$'()*,/:@?]+")
# RFC 2046 §5.1.1 bchars; the last one must not be a space.
_BOUNDARY = re.compile(rb"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")

# What follows a delimiter: a line end, or "--" for the last one. (Not RFC 2046's transport
# padding: python-multipart before 0.0.34 reads a padded delimiter as data, so two such bodies
# under two boundaries read apart. A padded body is hashed as sent.)
_LINE_END = re.compile(rb"\r\n")
_CLOSE = re.compile(rb"--(?:\r\n|\Z)")

_MEDIA_PARAM = re.compile(
    rb";[ \t]*([!#$%&'*+.^_`|~0-9A-Za-z-]+)[ \t]*=[ \t]*(\"(?:[^\"\\]|\\.)*\"|[^;]*)",
    re.DOTALL,
)
_QUOTED_PAIR = re.compile(rb"\\(.)", re.DOTALL)
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
# A Content-Type that readers cannot split differently (RFC 9110's syntax less quoted-pairs, which
# python-multipart keeps and parse_media_type unescapes): a media type, then parameters, each a
# token or a quoted string without a backslash, and nothing after them but spaces.
_PLAIN_MEDIA_TYPE = re.compile(
    _TOKEN
    + rb"/"
    + _TOKEN
    + rb"(?:[ \t]*;[ \t]*"
    + _TOKEN
    + rb"=(?:"
    + _TOKEN
    + rb'|"[\t\x20\x21\x23-\x5b\x5d-\x7e]*"))*[ \t]*'
)


def parse_media_type(content_type: bytes) -> tuple[bytes, dict[bytes, bytes]]:
    """(the media type in lower case, its parameters, names in lower case)."""
    essence, semicolon, _ = content_type.partition(b";")
    media_type = essence.strip(b" \t").lower()
    params: dict[bytes, bytes] = {}
    if semicolon:
        for match in _MEDIA_PARAM.finditer(content_type, len(essence)):
            raw = match.group(2)
            quoted = len(raw) > 1 and raw[:1] == b'"' and raw[-1:] == b'"'
            value = _QUOTED_PAIR.sub(rb"\1", raw[1:-1]) if quoted else raw.rstrip(b" \t")
            params.setdefault(match.group(1).lower(), value)
    return media_type, params


#: The longest Content-Type the parses are kept for (bytes). A process sees few content types,
#: and short ones; a client's own (1 MB each, under a server that takes such headers) were kept
#: 256 at a time, twice over: 382 MB held for good by 200 requests, refused ones included.
MAX_CACHED_TYPE = 256


def read_media_type(content_type: bytes) -> tuple[bytes, Mapping[bytes, bytes], bool]:
    """parse_media_type's answer (shared: read it, never edit it), and whether it is JSON."""
    if len(content_type) <= MAX_CACHED_TYPE:
        return _cached_media_type(content_type)
    return _media_type(content_type)


def _media_type(content_type: bytes) -> tuple[bytes, Mapping[bytes, bytes], bool]:
    media_type, params = parse_media_type(content_type)
    # One slash, as FastAPI requires to read a body as JSON (the email package's rule: a type
    # with two is text/plain to it, and its handler gets the bytes as sent).
    is_json = media_type == b"application/json" or (
        media_type.startswith(b"application/")
        and media_type.endswith(b"+json")
        and media_type.count(b"/") == 1
    )
    return media_type, params, is_json


_cached_media_type = lru_cache(maxsize=256)(_media_type)  # (a miss only costs the parse)


_RAW = b"raw"
_SORTED = b"sorted"
_SELECTED = b"selected"
_SEGMENTS = b"segments"


def too_many_fields(what: str, cap: int) -> RequestRejected:
    return RequestRejected(ProblemKind.TOO_MANY_FIELDS, f"{what} may hold at most {cap} fields.")


def canonical_pairs(
    data: bytes,
    *,
    what: str,
    max_fields: int,
    exclude: frozenset[bytes] = frozenset(),
    include: frozenset[bytes] | None = None,
) -> bytes:
    """Canonical bytes of an `&`-separated query string or form body.

    The fields are sorted by name (repeats keep their order) when every name is plain, every
    field has a `=`, and no `;` appears (some readers split on it too); otherwise the bytes stay
    as they are. Names in `exclude` are left out, and only names in `include` (when given) are
    kept, only in the sorted case, where a name means the same to every reader. One field is as
    it is unless a name is left out or kept: then it is a sorted list of one (a retry that adds
    only an excluded field matches).
    """
    # A C-level count first: the per-field work below is then bounded by the cap.
    if data.count(b"&") >= max_fields:
        raise too_many_fields(what, max_fields)
    # (find, not `in`: `in` would format a discarded TypeError)
    if data.find(b";") >= 0 or (data.find(b"&") < 0 and include is None and not exclude):
        return _RAW + data
    pairs = [(piece.partition(b"=")[0], piece) for piece in data.split(b"&")]
    plain = _PLAIN_NAME.fullmatch
    for name, piece in pairs:
        # (A piece without "=": python-multipart before 0.0.25 drops the last such field of a
        # form, so "b&a" and "a&b" read apart. Such data stays as it is.)
        if plain(name) is None or len(name) == len(piece):
            return _RAW + data
    if exclude:
        pairs = [pair for pair in pairs if pair[0] not in exclude]
    if include is not None:
        pairs = [pair for pair in pairs if pair[0] in include]
    # A stable sort: the order of different names is noise, the order of repeats is data.
    pairs.sort(key=itemgetter(0))
    chunks = [_SORTED if include is None else _SELECTED, _U64(len(pairs))]
    for _, piece in pairs:
        chunks.append(_U64(len(piece)))
        chunks.append(piece)
    return b"".join(chunks)


def _has_border(delimiter: bytes) -> bool:
    # A delimiter that overlaps itself ("---" for boundary "-", "--ab-" for "ab-", as 1-2% of
    # Java's and Dart's random boundaries) can be found at two overlapping places: `bytes.count`
    # finds one of them (see `_occurrences`).
    return any(delimiter[:k] == delimiter[-k:] for k in range(1, len(delimiter)))


def _occurrences(text: bytes, delimiter: bytes, most: int) -> int:
    """How many times `delimiter` is in `text`, overlapping ones too (up to `most` + 1)."""
    count, at = 0, text.find(delimiter)
    while at >= 0 and count <= most:
        count += 1
        at = text.find(delimiter, at + 1)
    return count


def multipart_boundary(content_type: bytes, boundary: bytes | None) -> bytes | None:
    """The boundary if the body can be split on it unambiguously, else None (hash it raw).

    The header must also name it so that every reader finds the same one: in plain syntax, in
    one `boundary` parameter (of two, python-multipart takes the last and parse_media_type the
    first), and its text must appear once, so that cutting it out of the header is unambiguous.
    """
    if boundary is None or _BOUNDARY.fullmatch(boundary) is None:
        return None
    if content_type.count(boundary) != 1:
        return None
    before, _, after = content_type.partition(boundary)
    if (before + after).lower().count(b"boundary") != 1:
        return None
    return boundary if _PLAIN_MEDIA_TYPE.fullmatch(content_type) is not None else None


def canonical_multipart(body: bytes, boundary: bytes, *, max_fields: int) -> bytes | None:
    """The body's pieces between its delimiters, each length-prefixed; None to hash it raw.

    Clients draw a fresh random boundary per attempt, so a retry must still match the
    original; the delimiter itself is never written, so no field value can imitate it. Only a
    body whose every occurrence of the delimiter text is a delimiter to any reader (at the start
    or after CRLF, then a line end, or "--" for the last) is cut: elsewhere the text is data
    to one reader and a delimiter to another, and the body is hashed as sent.
    """
    delimiter = b"--" + boundary
    # Parts are the delimiters less the closing one.
    if body.count(delimiter) > max_fields + 1:
        raise too_many_fields("A multipart body", max_fields)
    starts = body.startswith(delimiter)
    text = b"\r\n" + body if starts else body
    line_delimiter = b"\r\n" + delimiter
    # Every occurrence of the delimiter must be a line's: one anywhere else is data to one reader
    # and a delimiter to another. (The line delimiter cannot overlap itself: a boundary holds no
    # CR nor LF. The delimiter can: then its occurrences are counted one by one.)
    lines = text.count(line_delimiter)
    if _has_border(delimiter):
        if _occurrences(text, delimiter, lines) != lines:
            return None
    elif text.count(delimiter) != lines:
        return None
    segments = text.split(line_delimiter)
    last = len(segments) - 1
    if not last:
        # No delimiter at all: no form to any reader, but readers differ on it (python-multipart
        # reads `----` as an empty form under one boundary and refuses it under another).
        return None
    if _CLOSE.match(segments[last]) is None:
        return None
    for segment in segments[1:last]:
        line_end = _LINE_END.match(segment)
        # A part's headers must end inside it (a blank line: CRLF CRLF, the line end's own CRLF
        # included). Without one, a reader takes the next delimiter's line end as the blank line
        # and the delimiter's text, the boundary, as the part's data.
        if line_end is None or segment.find(b"\r\n\r\n", line_end.end() - 2) < 0:
            return None
    chunks = [_SEGMENTS, b"1" if starts else b"0", _U64(len(segments))]
    for segment in segments:
        chunks.append(_U64(len(segment)))
        chunks.append(segment)
    return b"".join(chunks)


def excluded_names(exclude_fields: Sequence[str]) -> frozenset[bytes]:
    """Top-level names among exclude_fields (plain names and one-token JSON Pointers)."""
    names: set[bytes] = set()
    for field in exclude_fields:
        if not field.startswith("/"):
            names.add(field.encode("utf-8", "surrogatepass"))
        elif "/" not in field[1:]:
            # RFC 6901: "~1" must be decoded before "~0", or "~01" would wrongly become "/".
            token = field[1:].replace("~1", "/").replace("~0", "~")
            names.add(token.encode("utf-8", "surrogatepass"))
    return frozenset(names)
