"""What of a parsed JSON body the fingerprint covers: `Policy.include_fields` and
`Policy.exclude_fields`, names or RFC 6901 JSON Pointers into objects and arrays.

Include, then exclude: every pointer means what it means in the body as sent, so all of them
are resolved before anything is removed (removing an element shifts those after it)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

__all__ = ["field_pointer", "is_json_pointer", "json_fields", "json_member"]


@lru_cache(maxsize=256)
def _pointer_tokens(pointer: str) -> tuple[str, ...]:
    # RFC 6901: "~1" must be decoded before "~0", or "~01" would wrongly become "/".
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/"))


# RFC 6901: "/" then reference tokens, in which "~" only starts "~0" or "~1".
_POINTER = re.compile(r"(?:/(?:[^~/]|~[01])*)*", re.DOTALL)
# (At most 18 digits: no array a capped body holds is longer, and `int()` of a configured token
# of thousands of digits raised at every request that reached it.)
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]{0,17}")


def is_json_pointer(text: str) -> bool:
    """Whether `text` is a non-empty RFC 6901 JSON Pointer."""
    return text.startswith("/") and _POINTER.fullmatch(text) is not None


def field_pointer(field: str) -> str:
    """A configured field as a JSON Pointer: pointers as they are, a plain name escaped."""
    if field.startswith("/"):
        return field
    return "/" + field.replace("~", "~0").replace("/", "~1")


def json_member(value: object, pointer: str) -> tuple[bool, object]:
    """(True, the value) at `pointer` in a parsed JSON value, or (False, None) where there is
    none: a missing member, an index past the end, or a step into a scalar."""
    target = value
    for token in _pointer_tokens(pointer):
        if isinstance(target, dict):
            if token not in target:
                return False, None
            target = target[token]
        elif isinstance(target, list) and _ARRAY_INDEX.fullmatch(token) is not None:
            index = int(token)
            if index >= len(target):
                return False, None
            target = target[index]
        else:
            return False, None
    return True, target


def json_fields(
    value: object, include_fields: Sequence[str], exclude_fields: Sequence[str]
) -> dict[str, object] | None:
    """Remove from `value`, in place, the members `exclude_fields` name; return the members
    `include_fields` name, keyed by pointer (a member that is absent has no entry, one that is
    null has a null), or None when it names none. A plain name is a pointer of one token."""
    # Found before anything is removed: (id of the container, key or index) -> the container.
    members: dict[tuple[int, str], dict[str, object]] = {}
    elements: dict[tuple[int, int], list[object]] = {}
    excluded: list[tuple[str, ...]] = []
    for field in exclude_fields:
        pointer = field_pointer(field)
        excluded.append(_pointer_tokens(pointer))
        parent, last = pointer[: pointer.rfind("/")], excluded[-1][-1]
        target = json_member(value, parent)[1] if parent else value
        if isinstance(target, dict):
            members[id(target), last] = target
        elif isinstance(target, list) and _ARRAY_INDEX.fullmatch(last) and int(last) < len(target):
            elements[id(target), int(last)] = target
    selected: dict[str, object] | None = None
    if include_fields:
        selected = {}
        for field in include_fields:
            pointer = field_pointer(field)
            tokens = _pointer_tokens(pointer)
            if any(tokens[: len(path)] == path for path in excluded):
                continue  # excluded, or inside what is
            found, member = json_member(value, pointer)
            if found:
                selected[pointer] = member  # (the tree's own: removals inside it show)
    for (_, name), members_of in members.items():
        members_of.pop(name, None)
    for key in sorted(elements, reverse=True):  # each list's last element first
        del elements[key][key[1]]
    return selected
