-- 0006: a transactional claim never waits inside the database. It reads the record first (a
-- replay takes no lock), then tries the key's advisory lock; a key another transaction is
-- claiming is reported at once, and the duplicate waits with no connection of the pool held.

-- Claim a key for a transaction that will write its record at commit. It never waits: the rows
-- say what it found. None: the key is free and this transaction now holds its lock. One: a record
-- holds the key (read it with `get`; an expired one is reported only under the lock, so that
-- reclaiming it is not a race). Two: another transaction is claiming it right now (the caller
-- rolls back, waits with no connection, and claims again). A live record is answered before the
-- lock is even computed, so replays never queue. The read after the lock is a statement of its
-- own: under READ COMMITTED it sees a record that a transaction which held the lock committed
-- between the two.
CREATE OR REPLACE FUNCTION idem_claim_key(p_tenant text, p_operation text, p_key text)
RETURNS SETOF integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_lock bigint;
BEGIN
    RETURN QUERY
        SELECT 1 FROM idem_requests
        WHERE tenant = p_tenant AND operation = p_operation AND idem_key = p_key
          AND (expires_at IS NULL OR expires_at > now());
    IF FOUND THEN
        RETURN;
    END IF;
    v_lock := idem_key_lock(p_tenant, p_operation, p_key);
    IF v_lock IS NULL THEN
        RAISE EXCEPTION 'idem_lock_secret has no row: run `idem-middleware migrate`';
    END IF;
    IF NOT pg_try_advisory_xact_lock(v_lock) THEN
        RETURN QUERY VALUES (2), (2);
        RETURN;
    END IF;
    RETURN QUERY
        SELECT 1 FROM idem_requests
        WHERE tenant = p_tenant AND operation = p_operation AND idem_key = p_key;
END
$$;
