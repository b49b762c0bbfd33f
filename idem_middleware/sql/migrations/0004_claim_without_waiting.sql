-- 0004: a transactional claim never waits inside the database. It reads the record first (a
-- replay takes no lock), then tries the key's advisory lock; a claim held by another transaction
-- is reported at once, and the duplicate waits with no connection of the pool held.

-- Claim a key for a transaction that will write its record at commit. The rows say what it
-- found: none, the key is free and this transaction now holds its lock; one, a record holds the
-- key (read it with `get`; an expired one is reported only under the lock, so that reclaiming it
-- is not a race); two, another transaction is claiming it right now (try again later).
-- The second read, after the lock, is a statement of its own: under READ COMMITTED it sees a
-- record that a transaction which held the lock committed between the two.
CREATE OR REPLACE FUNCTION idem_claim_key(p_tenant text, p_operation text, p_key text)
RETURNS SETOF integer
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN QUERY
        SELECT 1 FROM idem_requests
        WHERE tenant = p_tenant AND operation = p_operation AND idem_key = p_key
          AND (expires_at IS NULL OR expires_at > now());
    IF FOUND THEN
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(1768187245, idem_key_lock(p_tenant, p_operation, p_key)) THEN
        RETURN QUERY VALUES (2), (2);
        RETURN;
    END IF;
    RETURN QUERY
        SELECT 1 FROM idem_requests
        WHERE tenant = p_tenant AND operation = p_operation AND idem_key = p_key;
END
$$;
