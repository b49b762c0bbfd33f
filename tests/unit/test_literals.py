"""The fast path's planned argument lists (`literals.arguments`) write exactly what the literals
written one by one (`_literals`) write, or leave the values to them; never anything else.

`_literals` is the reference: its own tests (test_fused.py, test_sql_safety.py) read its literals
back through PostgreSQL under every setting that could bend them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from idem_middleware.errors import NotFusable
from idem_middleware.store.postgres import literals
from idem_middleware.store.postgres.fused import _execute
from idem_middleware.store.postgres.literals import _inline, _literals, arguments


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


def _reference(values: Any) -> str | type[NotFusable]:
    try:
        return ", ".join(_literals(values))
    except NotFusable:
        return NotFusable


@settings(max_examples=2000, deadline=None)
@given(st.lists(_VALUE, max_size=14))
@example(["t$", "op", "k", -1])
@example(["tenant-a", "POST /x/{id}", "k", -5, b"\x00\xff", 60.0, None, True])
@example(["t", float("nan")])
@example([Tenant("t"), "op"])
def test_planned_arguments_are_the_literals_or_nothing(values: list[Any]) -> None:
    try:
        written = arguments(values)
    except NotFusable:
        assert _reference(values) is NotFusable
        return
    if written is not None:
        assert written == _reference(values)
    else:  # left to `_literals`: text that is not plain, or a type without a plan
        plain = all(
            type(v) is not str or (v.isascii() and "$" not in v and "\x00" not in v) for v in values
        )
        assert not plain or any(type(v) not in literals._WRITTEN for v in values)


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


@pytest.mark.parametrize(
    "values",
    [
        ("tenant-a", "POST /accounts/{account_id}/credits", "k-1", -4_611_686_018_427_387_904),
        ("tenant-a", "POST /accounts/{account_id}/credits", "k-1", 7),
        ("t", "op", "k", b"\x01" * 32, 5, 86400.0, "succeeded", 201, b"ab", b"{}", None),
        ("t", "op", "k", 5, "pending", "unknown", None, 500, b"", b"", "streaming", None),
    ],
    ids=["claim", "claim-positive-lock", "completion", "settlement"],
)
def test_the_fast_paths_own_arguments_take_the_plan(values: tuple[Any, ...]) -> None:
    """The claim's and the completion's arguments, as the stores send them, are planned (a
    plan never taken would pass the test above)."""
    written = arguments(values)
    assert written is not None
    assert written == ", ".join(_literals(values))


def test_plans_are_kept_for_a_bounded_number_of_type_sequences() -> None:
    for n in range(1, 200):
        assert arguments((1,) * n) == ", ".join(["1"] * n)
    assert len(literals._PLANS) <= literals._MAX_PLANS


def test_a_non_finite_number_is_refused_as_the_literals_refuse_it() -> None:
    with pytest.raises(NotFusable, match="non-finite"):
        arguments(("t", math.inf))
