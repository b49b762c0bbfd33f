r"""The literals of the fast path's simple-query messages: where a client's bytes meet SQL.

Each value is written as an SQL expression whose text means the same whatever the session's
settings (a handler may change them between the claim and the completion:
`standard_conforming_strings` makes `\` an escape in quoted strings). Text is dollar-quoted,
`$v$...$v$`, which has no escapes under any setting, unless it holds a `$` (then hex, decoded by
the server); bytes are hex digits. The server parses a dollar-quoted constant once, where a
decoded one costs two function calls per value (about a third of the completion's server time).

`_literals` writes values one by one, each checked on its own. `arguments` writes the argument
list of an `EXECUTE` (twice per request) the same way, quicker: it checks all of the text at
once, and writes the literals with a format string made once per sequence of types; whatever it
does not write so (text that is not plain, a type it has no plan for) it leaves to `_literals`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from operator import itemgetter
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


#: A format string writing every literal of one sequence of types, joined by ", "; what picks
#: the text out of the values (None: no text); and the positions of the bytes, the ints and the
#: other numbers (floats, bools), whose literals depend on their values.
_Positions = tuple[int, ...]
_Plan = tuple[str, Callable[[Sequence[Any]], Any] | None, _Positions, _Positions, _Positions]
#: The types `arguments` plans for (exactly these: a str subclass, say, is left to `_literals`).
_WRITTEN = frozenset({str, bytes, int, float, bool, type(None)})
#: The sequences of types `arguments` has no plan for.
_NO_PLAN: _Plan = ("", None, (), (), ())
_PLANS: dict[tuple[type, ...], _Plan] = {}
#: Plans kept, at most: a statement's types vary only with its optional values (None or not).
_MAX_PLANS = 64


def _plan(kinds: tuple[type, ...]) -> _Plan:
    if not _WRITTEN.issuperset(kinds):
        return _NO_PLAN
    parts: list[str] = []
    texts: list[int] = []
    hexed: list[int] = []
    ints: list[int] = []
    others: list[int] = []
    for i, kind in enumerate(kinds):
        if kind is str:
            parts.append(f"$v${{{i}}}$v$::text")
            texts.append(i)
        elif kind is bytes:
            parts.append(f"$v$\\x{{{i}}}$v$::bytea")
            hexed.append(i)
        elif kind is type(None):
            parts.append("NULL")
        else:
            parts.append(f"{{{i}}}")
            (ints if kind is int else others).append(i)
    getter = itemgetter(*texts) if texts else None
    return ", ".join(parts), getter, tuple(hexed), tuple(ints), tuple(others)


def arguments(values: Sequence[Any]) -> str | None:
    """`", ".join(_literals(values))` for a UTF-8 connection, when all of the values' text is
    plain (ASCII without a `$` or a NUL) and every value has a type with a plan; None otherwise
    (then write them with `_literals`, which also says why a value cannot be written)."""
    kinds = tuple(map(type, values))
    plan = _PLANS.get(kinds)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[kinds] = _plan(kinds)
    if plan is _NO_PLAN:
        return None
    template, texts_of, hexed, ints, others = plan
    if texts_of is not None:
        # One search of all the text: a `$`, a NUL or a non-ASCII character is in the joined
        # text exactly when it is in one of the values (each is a single character). (One
        # value's getter returns the str itself, whose join is itself.)
        text = "".join(texts_of(values))
        if not text.isascii() or "$" in text or "\x00" in text:
            return None
    written = list(values)
    for i in hexed:
        written[i] = values[i].hex()
    for i in ints:
        if values[i] < 0:
            written[i] = f"({values[i]})"  # (see `_literals`)
    for i in others:  # floats and bools, one or none per statement
        written[i] = _literals((values[i],))[0]
    return template.format(*written)
