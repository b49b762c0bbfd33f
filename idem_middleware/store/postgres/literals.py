r"""The literals of the fast path's simple-query messages: where a client's bytes meet SQL.

Each value is written as an SQL expression whose text means the same whatever the session's
settings (a handler may change them between the claim and the completion:
`standard_conforming_strings` makes `\` an escape in quoted strings). Text is dollar-quoted,
`$v$...$v$`, which has no escapes under any setting, unless it holds a `$` (then hex, decoded by
the server); bytes are hex digits. The server parses a dollar-quoted constant once, where a
decoded one costs two function calls per value (about a third of the completion's server time).

`_literals` writes values one by one, each checked on its own. (A format string made once per
sequence of types, with all of the text checked at once, executed a third of the bytecodes and
took as long: the time is in C, in `str.format` and the type checks, not in the loop. See
docs/performance-history.md.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ...errors import NotFusable

_PLACEHOLDER = re.compile(r"\$(\d+)")


def _literal(value: Any, utf8: bool = True) -> str:
    """`value` as an SQL expression whose text means the same whatever the session's settings.

    Text without a `$` is dollar-quoted (`$v$...$v$::text`): a dollar-quoted string has no
    escapes under any setting, and with no `$` inside nothing can end it early. Other text is
    `convert_from(decode('<utf-8 hex>', 'hex'), 'UTF8')`, bytes `$v$\\x<hex>$v$::bytea` (hex
    digits only), numbers their digits (in parentheses when negative). NUL and lone surrogates
    are refused (the ordinary path reports them). `utf8=False` (the client encoding is not
    UTF-8): text and bytes only as hex the server decodes, `decode('<hex>', 'hex')` for bytes,
    which mean the same in any client encoding."""
    return _literals((value,), utf8)[0]


def _literals(values: Sequence[Any], utf8: bool = True) -> list[str]:
    """`_literal` of each of `values`, written in one loop: a call per value (fifteen per
    transactional request) cost more than most values' literals."""
    out: list[str] = []
    for value in values:
        kind = type(value)
        if kind is str:
            # Most text is plain ASCII with no `$` (and no NUL): one pass of each test, then
            # quoted.
            if utf8 and value.isascii() and "$" not in value and "\x00" not in value:
                out.append("$v$" + value + "$v$::text")
            else:
                out.append(_text(value, utf8))
        elif kind is bytes:
            if utf8:
                out.append("$v$\\x" + value.hex() + "$v$::bytea")
            else:
                out.append("decode('" + value.hex() + "', 'hex')")
        elif value is None:
            out.append("NULL")
        elif kind is bool:
            out.append("true" if value else "false")
        elif kind is int:
            # A leading minus in parentheses: glued to an operator's `-` it would start a
            # comment.
            out.append(str(value) if value >= 0 else f"({value})")
        else:
            out.append(_number(value))
    return out


def _number(value: Any) -> str:
    """`_literal` of a float; NotFusable for anything else `_literals` does not write."""
    if type(value) is not float:
        # Anything else (a str subclass a tenant resolver returned, say) takes the ordinary path.
        raise NotFusable(f"no literal for {type(value).__name__}")
    if not math.isfinite(value):
        raise NotFusable("a non-finite number")
    number = repr(value)  # digits, `.`, `e`, a sign: the shortest text of exactly this value
    return f"({number})" if number.startswith("-") else number


def _text(text: str, utf8: bool) -> str:
    """`_literal` of text that is not plain ASCII, holds a `$` or a NUL, or whose connection's
    client encoding is not UTF-8."""
    if "\x00" in text:
        raise NotFusable("a NUL character")  # PostgreSQL text cannot hold one
    try:
        data = text.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise NotFusable("not encodable as UTF-8") from exc
    if "$" in text or not utf8:
        return "convert_from(decode('" + data.hex() + "', 'hex'), 'UTF8')"
    return "$v$" + text + "$v$::text"


def _inline(query: str, args: Sequence[Any], utf8: bool = True) -> str:
    """`query` with each `$n` replaced by the literal of `args[n-1]` (our own queries only: they
    have no `$` inside string literals or comments)."""
    literals = _literals(args, utf8)
    return _PLACEHOLDER.sub(lambda m: literals[int(m.group(1)) - 1], query)
