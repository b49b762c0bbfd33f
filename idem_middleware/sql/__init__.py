"""The SQL the store runs, kept in .sql files and loaded by name."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def parse_named_queries(text: str) -> dict[str, str]:
    """Split a file of `-- name: x` blocks into {name: sql}."""
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        sql = "\n".join(
            line for line in body.strip().splitlines() if not line.lstrip().startswith("--")
        ).strip()
        queries[name] = sql.rstrip(";")
    return queries


@cache
def queries() -> dict[str, str]:
    return parse_named_queries(resources.files(__package__).joinpath("queries.sql").read_text())


def schema_sql() -> str:
    return resources.files(__package__).joinpath("schema.sql").read_text()


def migrations() -> list[tuple[int, str, str]]:
    """The numbered migrations as (version, name, sql), in order."""
    found = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append((int(match.group(1)), match.group(2), entry.read_text()))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return found
