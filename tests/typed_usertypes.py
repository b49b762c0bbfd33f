"""A user's typed code, never run: tests/integration/test_readme_examples.py type-checks it
under `mypy --strict` with the README's examples (each `type: ignore` below must be needed:
`--strict` reports one that is not)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.testclient import TestClient

from idem_middleware.pytest_plugin import Replay

# A misspelt name of a module with a `__getattr__` (sqla's, for Starlette without FastAPI) is an
# error, not a silent `Any`.
from idem_middleware.sqla import ClaimSesion  # type: ignore[attr-defined]

assert ClaimSesion


def a_sync_test(idem_replay: Replay) -> None:
    # docs/testing.md: with Starlette's TestClient, the two responses, without `await` (its
    # httpx2 base, unknown where httpx2 is not installed, matched the async client's overload).
    with TestClient(Starlette()) as client:
        first, second = idem_replay(client, "POST", "/orders", json={})
    assert first.status_code == second.status_code
