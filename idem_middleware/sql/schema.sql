-- The whole schema as the numbered migrations leave it. A test applies the migrations to an empty
-- database and checks that the result matches this file.

CREATE TABLE idem_schema_migrations (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- Every claim and takeover draws a generation from here, so a generation is never reused, even
-- for a key that was purged and claimed again: a late executor can never match a newer owner.
CREATE SEQUENCE idem_generation_seq;

CREATE TABLE idem_requests (
    tenant            text        NOT NULL,
    operation         text        NOT NULL,
    idem_key          text        NOT NULL,
    fingerprint       bytea       NOT NULL,
    state             text        NOT NULL,
    mode              text        NOT NULL,
    generation        bigint      NOT NULL DEFAULT nextval('idem_generation_seq'),
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    retention         interval    NOT NULL,
    lease_expires_at  timestamptz,
    expires_at        timestamptz,
    response_status   integer,
    response_headers  bytea,
    response_body     bytea,
    body_omitted      text,
    note              text,
    -- One life of the record: drawn from idem_generation_seq by the claim that inserts it or
    -- reclaims it after its retention, kept across takeovers and reconciliation. The downstream
    -- key derives from it, so a key reused after its retention is a new request downstream too.
    -- NULL for records claimed before migration 0005 (their downstream key is the older one).
    epoch             bigint,
    -- The generation an operator's `reopen` drew: while the record keeps it, it was reopened from
    -- an outcome, and only an operator settles it (see migration 0011).
    reopened_generation bigint,
    -- When `reconcile` last asked the record's reconciler and left it unknown, and under which
    -- generation: counted only while the record keeps it (see migration 0012).
    reconcile_asked_at timestamptz,
    reconcile_asked_generation bigint,
    -- The tenant leads, so the table can be distributed (Citus) and co-located by tenant.
    CONSTRAINT idem_requests_pkey PRIMARY KEY (tenant, operation, idem_key),
    CONSTRAINT idem_requests_state_check
        CHECK (state IN ('pending', 'succeeded', 'failed_final', 'unknown')),
    CONSTRAINT idem_requests_mode_check CHECK (mode IN ('transactional', 'lease')),
    CONSTRAINT idem_requests_key_length CHECK (octet_length(idem_key) BETWEEN 1 AND 255),
    -- Only finished outcomes expire and carry a response; pending and unknown never expire.
    CONSTRAINT idem_requests_final_check CHECK (
        (state IN ('succeeded', 'failed_final'))
            = (expires_at IS NOT NULL AND response_status IS NOT NULL)
    ),
    CONSTRAINT idem_requests_lease_check CHECK (state = 'pending' OR lease_expires_at IS NULL)
);

-- Purge walks expired finished records in batches.
CREATE INDEX idem_requests_expires_idx ON idem_requests (expires_at)
    WHERE expires_at IS NOT NULL;

-- Operators (and the stats an alert watches) look for unresolved records by age.
CREATE INDEX idem_requests_unresolved_idx ON idem_requests (state, updated_at)
    WHERE state IN ('pending', 'unknown');

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

-- Claim a key for a transaction that will write its record at commit; `p_lock` is
-- `idem_key_lock(tenant, operation, key)`, computed by the caller. It never waits: the rows say
-- what it found. None: the key is free and this transaction now holds its lock. One: a record
-- holds the key (read it with `get`; an expired one is reported only under the lock, so that
-- reclaiming it is not a race). Two: another transaction is claiming it right now (the caller
-- rolls back, waits with no connection, and claims again). A live record is answered before the
-- lock is even taken, so replays never queue. The read after the lock is a statement of its
-- own: under READ COMMITTED it sees a record that a transaction which held the lock committed
-- between the two.
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
CREATE FUNCTION idem_claim_key(p_tenant text, p_operation text, p_key text)
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

-- A token is stored only as its SHA-256. It is consumed by the claim of the idempotency record
-- whose key it is, and that claim marks it consumed.
CREATE TABLE idem_tokens (
    tenant          text        NOT NULL,
    token_hash      bytea       NOT NULL,
    operation       text        NOT NULL,
    request_digest  bytea,
    intent_id       text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    -- Set by the claim that consumed the token (cleared if that claim is released: nothing
    -- happened). A consumed token never admits another execution, whatever became of its record.
    consumed_at     timestamptz,
    CONSTRAINT idem_tokens_pkey PRIMARY KEY (tenant, token_hash),
    -- Issuing is idempotent: one token per (tenant, operation, intent).
    CONSTRAINT idem_tokens_intent_key UNIQUE (tenant, operation, intent_id)
);

-- Purge walks expired tokens, except the consumed tokens of an intent: those stay as tombstones,
-- so asking again for that intent is refused instead of issuing the same token afresh.
CREATE INDEX idem_tokens_expires_idx ON idem_tokens (expires_at)
    WHERE consumed_at IS NULL OR intent_id IS NULL;

-- Events written in the same transaction as the business write and the idempotency outcome.
CREATE TABLE idem_outbox (
    event_id         text        NOT NULL,
    tenant           text,
    topic            text        NOT NULL,
    payload          jsonb       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    sent_at          timestamptz,
    parked_at        timestamptz,
    last_error       text,
    CONSTRAINT idem_outbox_pkey PRIMARY KEY (event_id),
    CONSTRAINT idem_outbox_done_check CHECK (sent_at IS NULL OR parked_at IS NULL)
);

-- Publishers pick due, unsent, unparked events in order.
CREATE INDEX idem_outbox_due_idx ON idem_outbox (next_attempt_at)
    WHERE sent_at IS NULL AND parked_at IS NULL;

-- Purge picks events sent long enough ago.
CREATE INDEX idem_outbox_sent_idx ON idem_outbox (sent_at)
    WHERE sent_at IS NOT NULL;

-- A consumer records each event it applied, in its own transaction, so a redelivery is skipped.
CREATE TABLE idem_inbox (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idem_inbox_pkey PRIMARY KEY (consumer, event_id)
);

-- `inbox purge` picks rows recorded long enough ago.
CREATE INDEX idem_inbox_received_idx ON idem_inbox (received_at);

-- Lease-mode waiters, a row per wait (the record's notification payload, a random id): a
-- settlement notifies only when one waits. UNLOGGED: a crash empties it, and waiters poll.
CREATE UNLOGGED TABLE idem_waiters (
    token  text        NOT NULL,
    waiter bigint      NOT NULL,
    since  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idem_waiters_pkey PRIMARY KEY (token, waiter)
);

CREATE INDEX idem_waiters_since_idx ON idem_waiters (since);
