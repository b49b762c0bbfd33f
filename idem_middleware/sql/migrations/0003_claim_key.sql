-- 0003: transactional mode writes its record once, at commit (store/postgres.py, write-once).

-- The advisory lock that stands for an uncommitted transactional claim of a key: the first
-- key is 'idem' (0x6964656d); the second a hash of the key. Two keys sharing a hash only wait
-- for each other; the primary key, not this lock, keeps a key to one record.
CREATE FUNCTION idem_key_lock(p_tenant text, p_operation text, p_key text)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext(p_tenant || chr(31) || p_operation || chr(31) || p_key) $$;

-- Claim a key for a transaction that will write its record at commit: wait for any other
-- transaction claiming it (until that one ends), then return one row if a record holds the key
-- and none if it is free. The record is read after the wait, by a statement of its own, so
-- under READ COMMITTED it sees what the other transaction committed.
CREATE FUNCTION idem_claim_key(p_tenant text, p_operation text, p_key text)
RETURNS SETOF integer
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1768187245, idem_key_lock(p_tenant, p_operation, p_key));
    RETURN QUERY
        SELECT 1 FROM idem_requests
        WHERE tenant = p_tenant AND operation = p_operation AND idem_key = p_key;
END
$$;
