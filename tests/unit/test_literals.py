"""The fast path's `EXECUTE` is the statement its literals inline: for any values, hostile text
included, in either client encoding, or refused alike.

The literals themselves are read back through PostgreSQL under every setting that could bend
them in test_fused.py and test_sql_safety.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idem_middleware.errors import NotFusable
from idem_middleware.store.postgres.fused import _execute
from idem_middleware.store.postgres.literals import _inline


class Tenant(str):
    """A str subclass (a tenant resolver's own type, say): only the parameterised path takes it."""


#: Characters that matter to a literal (quotes, `$`, backslash, NUL, a lone surrogate,
#: non-ASCII), and plain ones.
_CHARS = st.one_of(
    st.sampled_from([*"$v'\\;-/*{}x \n\x00é東🙂", "\ud800"]),
    st.characters(codec="ascii"),
)
_TEXT = st.text(_CHARS, max_size=12)
_VALUE = st.one_of(
    _TEXT,
    _TEXT.filter(lambda t: t.isascii() and "$" not in t and "\x00" not in t),  # plain, often
    st.binary(max_size=8),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    _TEXT.map(Tenant),
)


@given(st.lists(_VALUE, max_size=8), st.booleans())
@settings(max_examples=500, deadline=None)
def test_an_execute_is_the_inlined_statement(values: list[Any], utf8: bool) -> None:
    """`_execute` says it writes what `_inline` makes of `EXECUTE name ($1, ...)`."""
    statement = "EXECUTE idem_x (" + ", ".join(f"${i + 1}" for i in range(len(values))) + ")"
    try:
        expected = _inline(statement, values, utf8)
    except NotFusable:
        with pytest.raises(NotFusable):
            _execute("idem_x", values, utf8)
        return
    assert _execute("idem_x", values, utf8) == expected
