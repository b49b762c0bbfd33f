-- 0007: the transactional claim takes the key's lock value from the caller. The store reads the
-- installation's secret once and computes `idem_key_lock` itself (the same HMAC, bit for bit),
-- so the server no longer plans that SQL function anew in every transaction. The three-argument
-- claim stays, computing the lock and calling this one: a process of an older version, still
-- running during a rolling upgrade, claims through it and takes the same lock.

-- `idem_claim_key(tenant, operation, key)` with `p_lock` = `idem_key_lock(tenant, operation,
-- key)` computed by the caller. Its rows mean the same: none, the key is free and this
-- transaction now holds its lock; one, a record holds the key; two, another transaction is
-- claiming it right now.
CREATE FUNCTION idem_claim_key(p_tenant text, p_operation text, p_key text, p_lock bigint)
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
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RETURN QUERY VALUES (2), (2);
        RETURN;
    END IF;
    RETURN QUERY
        SELECT 1 FROM idem_requests
        WHERE tenant = p_tenant AND operation = p_operation AND idem_key = p_key;
END
$$;

-- The claim of versions before 0007: the same, with the lock computed here.
CREATE OR REPLACE FUNCTION idem_claim_key(p_tenant text, p_operation text, p_key text)
RETURNS SETOF integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_lock bigint;
BEGIN
    v_lock := idem_key_lock(p_tenant, p_operation, p_key);
    IF v_lock IS NULL THEN
        RAISE EXCEPTION 'idem_lock_secret has no row: run `idem-middleware migrate`';
    END IF;
    RETURN QUERY SELECT * FROM idem_claim_key(p_tenant, p_operation, p_key, v_lock);
END
$$;
