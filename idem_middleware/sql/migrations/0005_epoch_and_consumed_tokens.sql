-- 0005: one life of a record (the downstream key's epoch), and consumed one-time tokens.

-- Drawn by the claim that inserts a record or reclaims it after its retention; kept across
-- takeovers and reconciliation. Records claimed before this migration keep NULL, and with it the
-- downstream key they were given (derived from the key space only).
ALTER TABLE idem_requests ADD COLUMN epoch bigint;

-- Set by the claim that consumes a token; a consumed token never admits another execution.
ALTER TABLE idem_tokens ADD COLUMN consumed_at timestamptz;

-- Tokens already used before this migration: a record of theirs still exists. (The record's key
-- is the token; tokens are stored as its SHA-256.)
UPDATE idem_tokens t SET consumed_at = r.created_at
FROM idem_requests r
WHERE r.tenant = t.tenant AND r.operation = t.operation
  AND sha256(convert_to(r.idem_key, 'UTF8')) = t.token_hash
  AND r.operation IN (SELECT DISTINCT operation FROM idem_tokens);

-- Purge keeps the consumed tokens of an intent as tombstones (see schema.sql).
DROP INDEX idem_tokens_expires_idx;
CREATE INDEX idem_tokens_expires_idx ON idem_tokens (expires_at)
    WHERE consumed_at IS NULL OR intent_id IS NULL;
