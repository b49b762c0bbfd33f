"""A role that may do everything on `idem_requests` but DELETE (a grant written as "SELECT,
INSERT, UPDATE", an audit-minded DBA's) is refused when the store opens, with the GRANT that
fixes it: a release deletes a record (a lease-mode request whose handler failed retryably, a
claim cancelled in flight), so it would open, serve, and then fail every release, leaving the
key pending until its lease ran out (privileges.py `NEEDED`)."""

from __future__ import annotations

import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ConfigurationError
from tests.integration.test_store_access import APP_GRANTS, Setup, role_database

__all__ = ["role_database"]  # (the fixture, used by name)


async def test_a_role_that_may_not_delete_records_is_refused_when_the_store_opens(
    role_database: Setup,
) -> None:
    dsn, role = await role_database(APP_GRANTS, "REVOKE DELETE ON idem_requests FROM {role}")
    with pytest.raises(ConfigurationError) as refused:
        await PostgresStore(dsn=dsn, listen=False).open()
    message = str(refused.value)
    assert f"the role {role} lacks privileges" in message
    assert f"GRANT DELETE ON public.idem_requests TO {role}" in message
