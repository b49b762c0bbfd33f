-- 0004: the advisory lock of a transactional claim is a 64-bit keyed hash (HMAC-SHA256 under a
-- secret of this installation), no longer a 32-bit hash anyone can compute.

-- One row: this installation's secret for `idem_key_lock`, made here from the server's strong
-- random source (gen_random_uuid draws from pg_strong_random; 4 UUIDs carry 488 random bits) and
-- kept as HMAC's two padded keys (the 64-byte secret XOR 0x36, and XOR 0x5c).
CREATE TABLE idem_lock_secret (
    singleton  boolean NOT NULL DEFAULT true,
    inner_key  bytea   NOT NULL,
    outer_key  bytea   NOT NULL,
    CONSTRAINT idem_lock_secret_pkey PRIMARY KEY (singleton),
    CONSTRAINT idem_lock_secret_singleton_check CHECK (singleton),
    CONSTRAINT idem_lock_secret_length_check
        CHECK (octet_length(inner_key) = 64 AND octet_length(outer_key) = 64)
);

INSERT INTO idem_lock_secret (inner_key, outer_key)
SELECT (SELECT decode(string_agg(lpad(to_hex(get_byte(k, i) # 54), 2, '0'), '' ORDER BY i), 'hex')
        FROM generate_series(0, 63) i),
       (SELECT decode(string_agg(lpad(to_hex(get_byte(k, i) # 92), 2, '0'), '' ORDER BY i), 'hex')
        FROM generate_series(0, 63) i)
FROM (SELECT decode(string_agg(replace(gen_random_uuid()::text, '-', ''), ''), 'hex') AS k
      FROM generate_series(1, 4)) secret;

-- The lock that stands for an uncommitted transactional claim of a key: the first 64 bits of
-- HMAC-SHA256(secret, the tuple), each part its UTF-8 bytes after their 4-byte length (so no two
-- tuples share an encoding). Without the secret nobody can aim a key at another's lock; two keys
-- sharing a lock by chance only wait for each other (the primary key keeps a key to one record).
DROP FUNCTION idem_key_lock(text, text, text);
CREATE FUNCTION idem_key_lock(p_tenant text, p_operation text, p_key text)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT ('x' || encode(substr(sha256(s.outer_key || sha256(s.inner_key
                || int4send(octet_length(t)) || t
                || int4send(octet_length(o)) || o
                || int4send(octet_length(k)) || k)), 1, 8), 'hex'))::bit(64)::bigint
    FROM idem_lock_secret s,
         convert_to(p_tenant, 'UTF8') t, convert_to(p_operation, 'UTF8') o, convert_to(p_key, 'UTF8') k
$$;

-- Claim a key for a transaction that will write its record at commit: wait for any other
-- transaction claiming it (until that one ends), then return one row if a record holds the key
-- and none if it is free. The record is read after the wait, by a statement of its own, so
-- under READ COMMITTED it sees what the other transaction committed.
CREATE OR REPLACE FUNCTION idem_claim_key(p_tenant text, p_operation text, p_key text)
RETURNS SETOF integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_lock bigint := idem_key_lock(p_tenant, p_operation, p_key);
BEGIN
    IF v_lock IS NULL THEN
        RAISE EXCEPTION 'idem_lock_secret has no row: run `idem-middleware migrate`';
    END IF;
    PERFORM pg_advisory_xact_lock(v_lock);
    RETURN QUERY
        SELECT 1 FROM idem_requests
        WHERE tenant = p_tenant AND operation = p_operation AND idem_key = p_key;
END
$$;
